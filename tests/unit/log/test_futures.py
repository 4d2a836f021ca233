"""when_all_done (dstl_ray/log/futures.py): ``fn`` runs exactly once, when the last future is
done; at once when all already are."""

from __future__ import annotations

import concurrent.futures
import threading

from dstl_ray.log.futures import when_all_done


def test_none_or_all_done_already_runs_at_once_in_this_thread():
    done = concurrent.futures.Future()
    done.set_result(1)
    for futures in ([], [done]):
        calls: list[threading.Thread] = []
        when_all_done(futures, lambda calls=calls: calls.append(threading.current_thread()))
        assert calls == [threading.current_thread()]


def test_runs_once_from_the_thread_that_completes_the_last():
    done, pending = concurrent.futures.Future(), [concurrent.futures.Future() for _ in range(3)]
    done.set_exception(RuntimeError("failed first"))  # done, however it ended
    calls = []
    when_all_done([done, *pending], lambda: calls.append(threading.current_thread().name))
    pending[0].set_result(1)
    pending[1].set_exception(RuntimeError("x"))
    assert calls == []
    t = threading.Thread(target=pending[2].set_result, args=(2,), name="last")
    t.start()
    t.join()
    assert calls == ["last"]


def test_futures_completed_from_many_threads_call_it_exactly_once():
    futures = [concurrent.futures.Future() for _ in range(200)]
    calls = []
    when_all_done(futures, lambda: calls.append(1))
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda f: f.set_result(None), futures))
    assert calls == [1]
