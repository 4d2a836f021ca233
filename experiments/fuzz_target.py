"""libFuzzer targets (atheris) for everything dstl-ray reads back from shared storage.

    python -m experiments.fuzz_target {format,handle} [libFuzzer flags] [corpus dirs]

Every input must decode or raise the format's own error (FormatError / HandleError): any
other exception, a hang (-timeout) or a memory blow-up (-rss_limit_mb) is a finding.
"""

from __future__ import annotations

import sys

import atheris

with atheris.instrument_imports():
    from dstl_ray.errors import FormatError, HandleError
    from dstl_ray.format import decode_file, iter_blocks
    from dstl_ray.handle import StateChangelogHandle


def target_format(data: bytes) -> None:
    try:
        decode_file(data, "fuzz.dstl")
    except FormatError:
        pass
    try:
        for _ in iter_blocks(data, path="fuzz.dstl"):
            pass
    except FormatError:
        pass


def target_handle(data: bytes) -> None:
    try:
        StateChangelogHandle.from_json(data)
    except HandleError:
        pass


TARGETS = {"format": target_format, "handle": target_handle}


def main() -> None:
    target = TARGETS[sys.argv[1]]
    atheris.Setup([sys.argv[0], *sys.argv[2:]], target)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
