"""Regenerate ``control_pb2.py``/``.pyi`` from ``control.proto``:
``python -m slipstream.contracts.control_codegen`` (needs the dev extra's grpcio-tools).

    control.proto --protoc (grpcio-tools)--> control_pb2.py, control_pb2.pyi (checked in)

protoc runs with the package root as include path, so the generated module registers the
file as ``slipstream/contracts/control.proto`` and imports stay package-absolute.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTO_NAME = "slipstream/contracts/control.proto"
GENERATED = ("control_pb2.py", "control_pb2.pyi")


def generate(out_dir: Path) -> list[Path]:
    """Run protoc on a copy of control.proto laid out as in the package; write into out_dir."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        proto = root / PROTO_NAME
        proto.parent.mkdir(parents=True)
        shutil.copy(HERE / "control.proto", proto)
        code = protoc.main(["protoc", f"-I{root}", f"--python_out={root}", f"--pyi_out={root}",
                            str(proto)])
        if code != 0:
            raise RuntimeError(f"protoc failed with exit code {code}")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for name in GENERATED:
            target = out_dir / name
            shutil.copy(proto.parent / name, target)
            written.append(target)
        return written


def main() -> int:
    for path in generate(HERE):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
