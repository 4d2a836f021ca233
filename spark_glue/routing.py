"""The operator's data path: a micro-batch's rows reach their subtasks as Arrow record batches.

Three steps, none of which pickles a row:

1. **Map side** (:func:`splitter`, run by ``DataFrame.mapInArrow`` in a Spark Python worker):
   the input's Arrow record batches are split by operator subtask, gathered into chunks of
   about a million rows (:func:`chunks`). The key group of a key is its hash under the
   job's key hash ``% max_parallelism`` (:mod:`dstl_ray.key_hashes`), computed once per
   DISTINCT key of the chunk (``dictionary_encode``; blake2b's remembered by the worker for
   the next batches, ``KeyGroupCache``); the rows are reordered by subtask with
   one ``take`` and each subtask's slice leaves as one Arrow IPC stream in one output row
   ``(route, subtask, payload)``.
2. **Shuffle in the JVM**: ``repartition(p, route)``. Spark hashes ``route`` with Murmur3
   (``pmod(hash(route), p)``); :func:`route_values` picks, per subtask ``i``, an int whose
   partition is ``i``, so partition ``i`` holds exactly subtask ``i``'s payloads.
3. **Reduce side** (:func:`read_payloads`): the task of partition ``i`` reads its payloads back
   into one Arrow table; :func:`group_by_key` orders it by key and finds each key's rows.

Python objects per row exist only where the user's per-key function asks for them
(:func:`rows_of`). Steps 1 and 2 become each micro-batch's Spark plan in
:mod:`spark_glue.route_plan`.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from .archives import keep_spark_archive_indexes

ROUTE, SUBTASK, PAYLOAD = "_dstl_route", "_dstl_subtask", "_dstl_payload"

_M32 = 0xFFFFFFFF
# the map side splits an input partition's rows a chunk at a time (:func:`chunks`): at most
# about this many rows or bytes held at once in the Spark Python worker
CHUNK_ROWS, CHUNK_BYTES = 1 << 20, 64 << 20


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (32 - r))) & _M32


def quoted(name: str) -> str:
    """A column name as Spark's ``col()`` takes it literally (a name with a dot or a
    backtick is no struct field)."""
    return "`" + name.replace("`", "``") + "`"


def int32(u: int) -> int:
    """The signed 32-bit int whose bits are ``u`` (0..2**32-1), as a Java int holds them."""
    return u - (1 << 32) if u & 0x80000000 else u


def spark_hash_int(value: int, seed: int = 42) -> int:
    """Spark SQL's ``hash()`` of an IntegerType value: Murmur3_x86_32 ``hashInt`` with seed
    42, as a signed 32-bit int (what its hash partitioning reduces modulo the partitions)."""
    k = (value & _M32) * 0xCC9E2D51 & _M32
    k = _rotl(k, 15) * 0x1B873593 & _M32
    h = _rotl(seed ^ k, 13)
    h = (h * 5 + 0xE6546B64) & _M32
    h ^= 4
    h ^= h >> 16
    h = h * 0x85EBCA6B & _M32
    h ^= h >> 13
    h = h * 0xC2B2AE35 & _M32
    h ^= h >> 16
    return int32(h)


def route_values(parallelism: int) -> tuple[int, ...]:
    """Per subtask ``i`` of ``parallelism``, the smallest int that Spark's hash partitioning
    of an int column into ``parallelism`` partitions (``pmod(hash(v), parallelism)``) sends
    to partition ``i``. Computed here, without a Spark job; a Spark test checks it against
    Spark's own ``hash``."""
    found: dict[int, int] = {}
    v = 0
    while len(found) < parallelism:
        found.setdefault(spark_hash_int(v) % parallelism, v)
        v += 1
    return tuple(found[i] for i in range(parallelism))


def routed_schema() -> Any:
    from pyspark.sql.types import BinaryType, IntegerType, StructField, StructType

    return StructType([StructField(ROUTE, IntegerType(), False),
                       StructField(SUBTASK, IntegerType(), False),
                       StructField(PAYLOAD, BinaryType(), False)])


def subtask_of(key: Any, max_parallelism: int, parallelism: int,
               key_hash: str = "blake2b") -> int:
    """Flink's operator index for the key's key group (the inverse of the range split),
    under the job's key hash (its name, dstl_ray.key_hashes)."""
    from dstl_ray.key_hashes import key_hash_named

    kg = key_hash_named(key_hash).key_group(key, max_parallelism)
    return kg * parallelism // max_parallelism


def _encoded(values: Any) -> tuple[list[Any], Any]:
    """The distinct values of an Arrow array (nulls included, first-seen order) as Python
    objects, and each value's index among them (numpy)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    enc = pc.dictionary_encode(values, null_encoding="encode")
    return enc.dictionary.to_pylist(), enc.indices.to_numpy(zero_copy_only=False)


def _grouped(codes: Any, n: int) -> tuple[Any, Any]:
    """The stable order that brings equal ``codes`` (ints in 0..n-1) together, and how many
    of each there are."""
    import numpy as np

    return np.argsort(codes, kind="stable"), np.bincount(codes, minlength=n)


def subtasks_of(keys: Any, max_parallelism: int, parallelism: int,
                key_hash: str = "blake2b") -> Any:
    """The subtask of every key of an Arrow array (numpy int32), each distinct key's group
    found once (:func:`subtask_of`, a column at a time; with blake2b, in this worker's
    :class:`~dstl_ray.keygroups.KeyGroupCache` when an earlier batch had the key)."""
    import numpy as np

    from dstl_ray.key_hashes import key_hash_named

    distinct, codes = _encoded(keys)
    groups = np.array(key_hash_named(key_hash).key_groups(distinct, max_parallelism),
                      dtype=np.int64)
    per_key = (groups * parallelism // max_parallelism).astype(np.int32)
    return per_key[codes]


def _ipc(table: Any) -> bytes:
    import pyarrow as pa

    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue().to_pybytes()


def chunks(batches: Iterable[Any], rows: int = CHUNK_ROWS, size: int = CHUNK_BYTES
           ) -> Iterator[Any]:
    """An input partition's record batches as tables of at least ``rows`` rows or ``size``
    bytes (the last one smaller; none empty). Spark hands ``mapInArrow`` batches of
    ``spark.sql.execution.arrow.maxRecordsPerBatch`` rows (10,000): split one by one, a
    million rows cost a hundred rounds of hashing the same distinct keys and a hundred IPC
    streams per subtask (twice the time of one round in a test of 1M rows over 1k keys)."""
    import pyarrow as pa

    buf: list[Any] = []
    n = nbytes = 0
    for b in batches:
        if b.num_rows == 0:
            continue
        buf.append(b)
        n, nbytes = n + b.num_rows, nbytes + b.nbytes
        if n >= rows or nbytes >= size:
            yield pa.Table.from_batches(buf)
            buf, n, nbytes = [], 0, 0
    if buf:
        yield pa.Table.from_batches(buf)


def combined(batches: Iterable[Any], combine: Callable[[Any], Any], key: str
             ) -> Iterator[Any]:
    """An input partition's rows through the operator's ``combine`` (a map-side combiner,
    Spark's partial aggregation: pandas in, pandas out, the key column kept), as one batch
    (none for an empty partition)."""
    import pyarrow as pa

    tables = [pa.Table.from_batches([b]) for b in batches if b.num_rows]
    if not tables:
        return
    out = combine(pa.concat_tables(tables).to_pandas())
    if key not in getattr(out, "columns", ()):
        raise ValueError(f"combine must return a pandas DataFrame with the key column "
                         f"{key!r}, got {type(out).__name__} {list(getattr(out, 'columns', []))}")
    yield from pa.Table.from_pandas(out, preserve_index=False).to_batches()


def splitter(key: str, max_parallelism: int, parallelism: int, routes: Sequence[int],
             combine: Callable[[Any], Any] | None = None, key_hash: str = "blake2b") -> Any:
    """The ``mapInArrow`` function of step 1 (a closure shipped to the executors), keys
    grouped by ``key_hash`` (the job's, by name: dstl_ray.key_hashes)."""
    routes = tuple(routes)

    def split(batches: Iterable[Any]) -> Iterator[Any]:
        import numpy as np
        import pyarrow as pa

        keep_spark_archive_indexes()  # this worker's next tasks start sooner

        if combine is not None:
            batches = combined(batches, combine, key)
        for b in chunks(batches):
            order, counts = _grouped(subtasks_of(b.column(key), max_parallelism, parallelism,
                                                 key_hash),
                                     parallelism)
            ordered = b.take(pa.array(order))
            rs, ss, ps = [], [], []
            off = 0
            for s in np.flatnonzero(counts):
                c = int(counts[s])
                rs.append(routes[s])
                ss.append(int(s))
                ps.append(_ipc(ordered.slice(off, c)))
                off += c
            yield pa.RecordBatch.from_arrays(
                [pa.array(rs, pa.int32()), pa.array(ss, pa.int32()), pa.array(ps, pa.binary())],
                names=[ROUTE, SUBTASK, PAYLOAD])

    return split


def read_payloads(index: int, rows: Iterable[Any]) -> Any:
    """Step 3: the Arrow table of one subtask's payload rows (None when it got no rows). A row
    of another subtask means Spark did not partition as :func:`route_values` found: fail loudly
    rather than apply a key to a subtask that does not own its key group."""
    import pyarrow as pa

    tables = []
    for r in rows:
        if r[1] != index:
            raise RuntimeError(f"subtask {index} was sent a payload of subtask {r[1]}: Spark's "
                               f"hash partitioning did not keep the route")
        tables.append(pa.ipc.open_stream(r[2]).read_all())
    if not tables:
        return None
    return pa.concat_tables(tables, promote_options="permissive") if len(tables) > 1 \
        else tables[0]


@dataclass(frozen=True)
class Groups:
    """One subtask's rows ordered by key: key ``keys[i]``'s rows are
    ``table[offsets[i]:offsets[i + 1]]``."""

    table: Any  # pyarrow.Table
    keys: list[Any]
    offsets: Any  # numpy int64, len(keys) + 1

    @property
    def rows(self) -> int:
        return 0 if self.table is None else self.table.num_rows


EMPTY = Groups(None, [], None)


def group_by_key(table: Any, key: str) -> Groups:
    """The rows of ``table`` ordered by key (first-seen order of the keys; within a key, the
    rows keep their order)."""
    import numpy as np
    import pyarrow as pa

    if table is None or table.num_rows == 0:
        return EMPTY
    distinct, codes = _encoded(table.column(key))
    order, counts = _grouped(codes, len(distinct))
    offsets = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    return Groups(table.take(pa.array(order)), distinct, offsets)


def row_class(names: Sequence[str]) -> type:
    """A ``pyspark.sql.Row`` subclass for rows of the fields ``names``: every row of a batch
    shares the field names (a class attribute, where ``Row`` sets one list per row), and a
    field is found by name through a dict (``Row`` searches its list). Rows read, compare,
    print (``asDict``, ``repr``) and pickle as plain ``Row`` objects do."""
    from pyspark.sql import Row

    index = {n: i for i, n in enumerate(names)}
    at = tuple.__getitem__

    class FieldRow(Row):
        __fields__ = list(names)

        def __getitem__(self, item: Any) -> Any:
            if type(item) is str:
                i = index.get(item)
                if i is None:
                    return Row.__getitem__(self, item)  # Row's own error
                return at(self, i)
            return at(self, item)

        def __getattr__(self, item: str) -> Any:
            i = index.get(item)
            if i is None or item.startswith("__"):
                raise AttributeError(item)
            return at(self, i)

    FieldRow.__name__ = FieldRow.__qualname__ = "Row"
    return FieldRow


def rows_of(table: Any) -> list[Any]:
    """``table``'s rows as ``pyspark.sql.Row`` objects, by name or position, for the per-key
    update API (values as Arrow gives them: a struct is a dict, a map a list of pairs, a
    timestamp timezone-aware). Made by the column, without ``Row``'s per-row checks (a
    micro-batch of a million rows spent most of its per-key time building them)."""
    if table is None or table.num_rows == 0:
        return []
    cls, new = row_class(table.column_names), tuple.__new__
    columns = [c.to_pylist() for c in table.columns]
    was = gc.isenabled()
    gc.disable()  # a million new objects, none in a cycle: collections would only slow it 4x
    try:
        return [new(cls, t) for t in zip(*columns, strict=True)]
    finally:
        if was:
            gc.enable()
