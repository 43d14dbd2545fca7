"""Profile tables on disk: per-layer operation times on a grid, and their fast lookup.

    profiler (engine, on the device) --write_profile()--> DIR/<op>.csv + DIR/profile.json
    DIR --load_profile()--> ProfileTables --> RuntimePredictor (predictor.py) --> packer

Format of a profile directory (the Vidur layout, plus one JSON file of our own):

- ``<op>.csv`` or ``<op>.csv.xz``: header ``X_0,prediction`` or ``X_0,X_1,prediction``,
  one row per grid point, times in milliseconds per layer. Linear ops (``mlp_up_proj``,
  ``attn_pre_proj``, ...) are keyed by the number of tokens in the batch; ``attn_prefill``
  by (KV tokens already cached, chunk tokens); ``attn_decode`` by (decode batch size, KV tokens
  the batch reads in total). A 2-D table must be a full grid.
- ``profile.json``: ``{"format_version": 1, "device": ..., "tp": ..., "num_layers": ...,
  "model": {hidden_size, ...}, "iteration_overhead_ms": ..., "per_sequence_overhead_ms": ...,
  "host_overhead_ms": ..., "host_per_sequence_ms": ..., "op_counts_per_layer": {...},
  "linear_profiled_max_tokens": ...}``. Vidur directories have no such file; callers pass a
  ``ProfileMeta`` for them (``VIDUR_H100_LLAMA3_8B_TP8`` below).

Random-forest predictions wobble, so every table is made monotone non-decreasing along each
axis (a running maximum) when loaded: the packer's binary search needs time to grow with the
chunk. Parsing two million CSV rows takes seconds, so the parsed grids are cached as ``.npz``
under ``~/.cache/slipstream/profiles`` keyed by the source files' size and mtime.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import lzma
from array import array
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

PROFILE_FORMAT_VERSION = 1
PREFILL_ATTENTION_OP = "attn_prefill"
DECODE_ATTENTION_OP = "attn_decode"
ATTENTION_OPS = (PREFILL_ATTENTION_OP, DECODE_ATTENTION_OP)
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "slipstream" / "profiles"


@dataclass(frozen=True)
class ProfileMeta:
    """What the tables were measured on, and how to add them up into one iteration."""

    num_layers: int
    device: str = "unknown"
    tp: int = 1
    model: dict = field(default_factory=dict)
    iteration_overhead_ms: float = 0.0  # CPU time per iteration outside the layers
    # Work that grows with the number of sequences in a batch rather than with tokens: tensor
    # preparation, sampling, and (in the torch reference backend) decode attention padded to
    # the longest sequence. Fitted by the profiler; 0 for the H100 tables.
    per_sequence_overhead_ms: float = 0.0
    # Runner time per prefill token that the tables do not hold (their ops timed one by one
    # miss what a chunk of hundreds of tokens costs in a real step); fitted with the two above.
    per_prefill_token_overhead_ms: float = 0.0
    # The engine's own host work per step around the model runner (schedule, request-state
    # update, detokenization and stop checks), ``host_overhead_ms + host_per_sequence_ms *
    # sequences``; fitted by the profiler on whole engine steps. 0 for the H100 tables.
    host_overhead_ms: float = 0.0
    host_per_sequence_ms: float = 0.0
    op_counts_per_layer: dict = field(default_factory=dict)  # op -> calls per layer (default 1)
    linear_profiled_max_tokens: int | None = None  # tables are flat (unmeasured) above this
    # KV tier bandwidths measured with the tables (0: not measured): host -> device copies
    # of KV blocks, and reads from the file system of the cache directory.
    host_load_gb_per_s: float = 0.0
    disk_read_gb_per_s: float = 0.0

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError("num_layers must be >= 1")
        if self.tp < 1:
            raise ValueError("tp must be >= 1")
        if self.iteration_overhead_ms < 0:
            raise ValueError("iteration_overhead_ms must be >= 0")
        if self.per_sequence_overhead_ms < 0 or self.per_prefill_token_overhead_ms < 0:
            raise ValueError("per-sequence and per-prefill-token overheads must be >= 0")
        if self.host_overhead_ms < 0 or self.host_per_sequence_ms < 0:
            raise ValueError("host overheads must be >= 0")

    def to_json(self) -> dict:
        return {"format_version": PROFILE_FORMAT_VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, data: dict) -> ProfileMeta:
        version = data.get("format_version", PROFILE_FORMAT_VERSION)
        if version != PROFILE_FORMAT_VERSION:
            raise ValueError(f"unsupported profile format_version {version}")
        known = {name for name in cls.__dataclass_fields__}
        return cls(**{key: value for key, value in data.items() if key in known})


# Llama-3-8B at TP 8 on H100 (project-vajra's Vidur predictions, shipped in sim/data/perf/).
VIDUR_H100_LLAMA3_8B_TP8 = ProfileMeta(
    num_layers=32,
    device="h100",
    tp=8,
    model={"name": "llama-3-8b", "hidden_size": 4096, "num_attention_heads": 32,
           "num_key_value_heads": 8, "intermediate_size": 14336},
    linear_profiled_max_tokens=4096,
)


class Grid1D:
    """Piecewise-linear y(x) on sorted grid points, clamped at the ends."""

    def __init__(self, xs: np.ndarray, ys: np.ndarray) -> None:
        if len(xs) < 2 or len(xs) != len(ys):
            raise ValueError("a 1-D table needs at least two points and equal lengths")
        self.xs = np.asarray(xs, dtype=np.float64)
        self.ys = np.maximum.accumulate(np.asarray(ys, dtype=np.float64))
        self.x_min, self.x_max = float(self.xs[0]), float(self.xs[-1])
        self._xs = self.xs.tolist()
        self._ys = self.ys.tolist()
        self._step = _uniform_step(self.xs)

    def __call__(self, x: float) -> float:
        xs, ys = self._xs, self._ys
        if x <= self.x_min:
            return ys[0]
        if x >= self.x_max:
            return ys[-1]
        if self._step:
            i = int((x - self.x_min) / self._step)
            i = min(i, len(xs) - 2)
        else:
            i = bisect.bisect_right(xs, x) - 1
        x0 = xs[i]
        frac = (x - x0) / (xs[i + 1] - x0)
        return ys[i] + (ys[i + 1] - ys[i]) * frac


class Grid2D:
    """Bilinear z(a, b) on a full grid, clamped at the edges."""

    def __init__(self, a_values: np.ndarray, b_values: np.ndarray, z: np.ndarray) -> None:
        if z.shape != (len(a_values), len(b_values)) or min(z.shape) < 2:
            raise ValueError("a 2-D table needs a full grid of at least 2x2 points")
        self.a_values = np.asarray(a_values, dtype=np.float64)
        self.b_values = np.asarray(b_values, dtype=np.float64)
        z = np.maximum.accumulate(np.asarray(z, dtype=np.float64), axis=0)
        self.z = np.maximum.accumulate(z, axis=1)
        self.a_max, self.b_max = float(self.a_values[-1]), float(self.b_values[-1])
        self._a = self.a_values.tolist()
        self._b = self.b_values.tolist()
        self._a_step = _uniform_step(self.a_values)
        self._b_step = _uniform_step(self.b_values)
        # A flat array('d') indexes into Python floats several times faster than ndarray.item.
        self._flat = array("d", self.z.ravel().tolist())
        self._width = len(self._b)

    def __call__(self, a: float, b: float) -> float:
        i, fa = _locate(self._a, self._a_step, a)
        j, fb = _locate(self._b, self._b_step, b)
        flat, row = self._flat, i * self._width + j
        z00, z01 = flat[row], flat[row + 1]
        z10, z11 = flat[row + self._width], flat[row + self._width + 1]
        top = z00 + (z01 - z00) * fb
        return top + (z10 + (z11 - z10) * fb - top) * fa


def _uniform_step(values: np.ndarray) -> float:
    steps = np.diff(values)
    if np.any(steps <= 0):
        raise ValueError("grid axis must be strictly increasing")
    return float(steps[0]) if np.allclose(steps, steps[0]) else 0.0


def _locate(axis: list[float], step: float, x: float) -> tuple[int, float]:
    """Index of the cell holding ``x`` and the fraction into it, clamped to the axis."""
    if x <= axis[0]:
        return 0, 0.0
    if x >= axis[-1]:
        return len(axis) - 2, 1.0
    i = min(int((x - axis[0]) / step), len(axis) - 2) if step else bisect.bisect_right(axis, x) - 1
    return i, (x - axis[i]) / (axis[i + 1] - axis[i])


@dataclass
class ProfileTables:
    """The grids of one profile directory as measured, ms per layer (monotone only once wrapped)."""

    meta: ProfileMeta
    linear: dict[str, tuple[np.ndarray, np.ndarray]]  # op -> (tokens, ms)
    prefill_attention: tuple[np.ndarray, np.ndarray, np.ndarray]  # kv, chunk, ms[kv, chunk]
    decode_attention: tuple[np.ndarray, np.ndarray, np.ndarray]  # batch, kv_total, ms[b, kv]


def load_profile(directory: str | Path, meta: ProfileMeta | None = None,
                 cache_dir: Path | None = DEFAULT_CACHE_DIR) -> ProfileTables:
    """Read a profile directory; ``meta`` overrides (or stands in for) ``profile.json``."""
    directory = Path(directory)
    if meta is None:
        meta_path = directory / "profile.json"
        if not meta_path.exists():
            raise FileNotFoundError(f"{meta_path} is missing; pass a ProfileMeta for this directory")
        meta = ProfileMeta.from_json(json.loads(meta_path.read_text()))
    sources = _table_files(directory)
    missing = [op for op in ATTENTION_OPS if op not in sources]
    if missing:
        raise FileNotFoundError(f"profile {directory} lacks {missing}")
    arrays = _load_cached(sources, cache_dir)
    linear = {}
    for op in sorted(sources):
        if op in ATTENTION_OPS:
            continue
        tokens, ms = arrays[f"{op}__x0"], arrays[f"{op}__y"]
        if meta.linear_profiled_max_tokens is not None:
            keep = tokens <= meta.linear_profiled_max_tokens
            tokens, ms = tokens[keep], ms[keep]
        linear[op] = (tokens, ms)
    return ProfileTables(
        meta=meta,
        linear=linear,
        prefill_attention=_grid_arrays(arrays, PREFILL_ATTENTION_OP),
        decode_attention=_grid_arrays(arrays, DECODE_ATTENTION_OP),
    )


def write_profile(directory: str | Path, tables: dict[str, np.ndarray], meta: ProfileMeta) -> Path:
    """Write measured tables in the format ``load_profile`` reads.

    ``tables`` maps an op name to an array of rows: ``(x0, ms)`` for linear ops and
    ``(x0, x1, ms)`` for ``attn_prefill`` / ``attn_decode`` (a full grid, any row order).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for op, rows in tables.items():
        rows = np.asarray(rows, dtype=np.float64)
        if rows.ndim != 2 or rows.shape[1] not in (2, 3):
            raise ValueError(f"{op}: rows must be (x0, ms) or (x0, x1, ms)")
        if (op in ATTENTION_OPS) != (rows.shape[1] == 3):
            raise ValueError(f"{op}: attention ops have two keys, linear ops one")
        header = "X_0,prediction" if rows.shape[1] == 2 else "X_0,X_1,prediction"
        lines = [header] + [",".join(_format_number(v) for v in row) for row in rows]
        (directory / f"{op}.csv").write_text("\n".join(lines) + "\n")
    (directory / "profile.json").write_text(json.dumps(meta.to_json(), indent=2) + "\n")
    return directory


def _format_number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _table_files(directory: Path) -> dict[str, Path]:
    files: dict[str, Path] = {}
    for path in sorted(directory.iterdir()):
        for suffix in (".csv.xz", ".csv"):
            if path.name.endswith(suffix):
                files.setdefault(path.name[: -len(suffix)], path)
    return files


def _load_cached(sources: dict[str, Path], cache_dir: Path | None) -> dict[str, np.ndarray]:
    stamp = "|".join(f"{p.resolve()}:{p.stat().st_size}:{p.stat().st_mtime_ns}"
                     for p in sources.values())
    cache_path = None
    if cache_dir is not None:
        cache_path = Path(cache_dir) / (hashlib.sha256(stamp.encode()).hexdigest()[:24] + ".npz")
        if cache_path.exists():
            with np.load(cache_path) as cached:
                return dict(cached)
    arrays: dict[str, np.ndarray] = {}
    for op, path in sources.items():
        arrays.update(_parse_table(op, path))
    if cache_path is not None:
        try:
            cache_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache_path.with_suffix(".tmp.npz")
            np.savez(tmp, **arrays)  # type: ignore[arg-type]  # numpy's stub types allow_pickle only
            tmp.replace(cache_path)
        except OSError:
            pass  # a read-only home only costs the next load its parse time
    return arrays


def _parse_table(op: str, path: Path) -> dict[str, np.ndarray]:
    raw = lzma.open(path).read() if path.name.endswith(".xz") else path.read_bytes()
    header, _, body = raw.partition(b"\n")
    columns = header.decode().strip().split(",")
    if columns[-1] != "prediction" or len(columns) not in (2, 3):
        raise ValueError(f"{path}: unexpected header {columns}")
    fields = b",".join(body.split()).split(b",")
    values = np.array(fields, dtype=np.float64).reshape(-1, len(columns))
    if len(columns) == 2:
        order = np.argsort(values[:, 0], kind="stable")
        return {f"{op}__x0": values[order, 0], f"{op}__y": values[order, 1]}
    a_values, b_values = np.unique(values[:, 0]), np.unique(values[:, 1])
    if len(a_values) * len(b_values) != len(values):
        raise ValueError(f"{path}: not a full grid ({len(values)} rows)")
    grid = np.empty((len(a_values), len(b_values)))
    grid[np.searchsorted(a_values, values[:, 0]), np.searchsorted(b_values, values[:, 1])] = values[:, 2]
    return {f"{op}__x0": a_values, f"{op}__x1": b_values, f"{op}__y": grid}


def _grid_arrays(arrays: dict[str, np.ndarray], op: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return arrays[f"{op}__x0"], arrays[f"{op}__x1"], arrays[f"{op}__y"]
