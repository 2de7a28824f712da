"""What travels between tapc's API side and the engine's worker: typed, frozen values, and
their wire form (plain dicts, lists, strings, numbers and bytes; no pickle of the message).

Two messages, each with a `version`:
- `WireRequest`: one submitted request's checked ask and its tapc id, in
  `SamplingParams.extra_args["tapc"]` (vLLM msgpack-serializes SamplingParams to the engine
  core; an HTTP server reaches the same place through `vllm_xargs`).
- `CollectReply`: the `tapc_collect` answer (a `collective_rpc` reply), one `Result` per id:
  where each capture's rows lie in the arena, engine-point tensors as raw bytes, blocks'
  saved values, and why a request failed.

Both ends hold the typed values; `to_wire` / `from_wire` are the only conversions, and a
message of another version, or one that is malformed, is a `ProtocolError` naming the field.
A change to what a field means, or a field added or removed, bumps `VERSION`.
One field holds code, not data: `Ask.blocks`, per-request Python blocks cloudpickled by the
offline API in the caller's own process (docs/blocks.md). A server must never fill it from a
request.
"""
from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Union

import pybase64  # base64 in SIMD, as vLLM (which requires it) decodes its own: 30x the stdlib's

from tapc.errors import ProtocolError

if TYPE_CHECKING:   # torch is imported where a tensor is made: `tapc explain` checks requests without it
    import torch

VERSION = 4

# A request's value of a named parameter as checked by requests.py: float32 bytes for a
# vector, a float for a scalar, a list of ints for columns, a list of floats for values, and
# bytes for patch rows (tapc/lang/edits.py `patch_rows`).
ParamValue = Union[bytes, float, list]


def wire_field(d: Mapping, name: str, types, what: str):
    """`d[name]`, a ProtocolError naming it unless it is there and of one of `types`."""
    if name not in d:
        raise ProtocolError(f"{what}: no field {name!r}")
    value = d[name]
    if not isinstance(value, types):
        raise ProtocolError(f"{what}: field {name!r} is a {type(value).__name__}")
    return value


def _check_version(d, what: str) -> None:
    if not isinstance(d, Mapping):
        raise ProtocolError(f"{what}: expected a dict, got a {type(d).__name__}")
    version = d.get("version")
    if version != VERSION:
        raise ProtocolError(f"{what} of protocol version {version!r}, but this side speaks version {VERSION}: "
                            "the API and the engine's worker run different tapc versions")


# ----------------------------------------------------------------------------- requests


@dataclass(frozen=True)
class Ask:
    """One request's taps, checked against the plan (requests.check): the same for every prompt
    that shares a `TapRequest`."""

    capture: tuple[str, ...] = ()            # in-graph capture keys
    engine: tuple[str, ...] = ()             # engine-point captures: "logits", "samples"
    positions: str | tuple[int, ...] = "all"  # tapc/wire/positions.py
    params: Mapping[str, ParamValue] = field(default_factory=dict)
    blocks: bytes | None = None              # per-request blocks (cloudpickled by the offline API)

    @property
    def empty(self) -> bool:
        """Captures nothing and binds no parameter."""
        return not (self.capture or self.engine or self.params or self.blocks)


@dataclass(frozen=True)
class WireRequest:
    """A submitted request's ask and tapc's id for it (made once, by the API side)."""

    id: str
    ask: Ask

    def to_wire(self) -> dict:
        a = self.ask
        return {"version": VERSION, "id": self.id, "capture": list(a.capture), "engine": list(a.engine),
                "positions": a.positions if isinstance(a.positions, str) else list(a.positions),
                "params": dict(a.params), "blocks": a.blocks}

    def to_text(self) -> str:
        """The wire form as JSON text, vectors' bytes in base64: what an HTTP server puts in a
        request's `vllm_xargs`, which carries strings, numbers and lists only. `from_wire`
        reads either form. No blocks: a server never takes code from a request."""
        if self.ask.blocks is not None:
            raise ProtocolError("tapc request: per-request blocks do not travel as text")
        d = self.to_wire()
        d["params"] = {k: {"base64": pybase64.b64encode(v).decode()} if isinstance(v, bytes) else v
                       for k, v in d["params"].items()}
        return json.dumps(d)

    @classmethod
    def from_wire(cls, d) -> "WireRequest":
        what = "tapc request"
        if isinstance(d, str):
            d = _from_text(d, what)
        _check_version(d, what)
        positions = wire_field(d, "positions", (str, list, tuple), what)
        blocks = d.get("blocks")
        if blocks is not None and not isinstance(blocks, bytes):
            raise ProtocolError(f"{what}: field 'blocks' is a {type(blocks).__name__}")
        params = dict(wire_field(d, "params", Mapping, what))
        bad = next((k for k, v in params.items() if not _is_param_value(v)), None)
        if bad is not None:
            raise ProtocolError(f"{what}: parameter {bad!r} is a {type(params[bad]).__name__}, not bytes, a "
                                "number or a list of numbers")
        if not isinstance(positions, str) and not all(_is_number(p) for p in positions):
            raise ProtocolError(f"{what}: field 'positions' holds something other than numbers")
        ask = Ask(capture=tuple(wire_field(d, "capture", (list, tuple), what)),
                  engine=tuple(wire_field(d, "engine", (list, tuple), what)),
                  positions=positions if isinstance(positions, str) else tuple(positions),
                  params=params, blocks=blocks)
        return cls(wire_field(d, "id", str, what), ask)


def _from_text(text: str, what: str) -> dict:
    """`WireRequest.to_text`'s JSON back to the wire form."""
    try:
        d = json.loads(text)
    except ValueError as e:
        raise ProtocolError(f"{what}: not JSON ({e})") from None
    params = d.get("params") if isinstance(d, dict) else None
    if isinstance(params, dict):
        try:
            d["params"] = {k: pybase64.b64decode(v["base64"], validate=True) if isinstance(v, dict) else v
                           for k, v in params.items()}
        except (KeyError, TypeError, ValueError) as e:
            raise ProtocolError(f"{what}: a vector parameter is not {{'base64': ...}} ({e})") from None
    return d


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_param_value(v) -> bool:
    return isinstance(v, bytes) or _is_number(v) or (isinstance(v, (list, tuple)) and all(_is_number(x) for x in v))


# ----------------------------------------------------------------------------- values


@dataclass(frozen=True)
class TensorData:
    """A CPU tensor as raw bytes, dtype and shape."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes

    @classmethod
    def of(cls, t: torch.Tensor) -> "TensorData":
        import torch

        t = t.detach().to("cpu").contiguous()
        return cls(str(t.dtype).removeprefix("torch."), tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes())

    def tensor(self) -> torch.Tensor:
        import torch

        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ProtocolError(f"tensor of unknown dtype {self.dtype!r}")
        if not self.data:
            return torch.empty(self.shape, dtype=dtype)
        return torch.frombuffer(bytearray(self.data), dtype=torch.uint8).view(dtype).reshape(self.shape)

    def to_wire(self) -> dict:
        return {"dtype": self.dtype, "shape": list(self.shape), "data": self.data}

    @classmethod
    def from_wire(cls, d) -> "TensorData":
        what = "tensor"
        return cls(wire_field(d, "dtype", str, what), tuple(wire_field(d, "shape", (list, tuple), what)),
                   wire_field(d, "data", bytes, what))


_SCALARS = (type(None), bool, int, float, str, bytes)
SAVEABLE = "a tensor, None, a bool, int, float, str or bytes, or a list, tuple or dict (str keys) of these"


def encode_value(value: Any, where: str = "value") -> list:
    """A value a block saves (`ctx.save`), in wire form: tensors as `TensorData`, containers
    tagged so that tuples come back as tuples. Anything else is a TypeError naming `where`."""
    torch = sys.modules.get("torch")   # no torch loaded: the value is no tensor
    if torch is not None and isinstance(value, torch.Tensor):
        return ["tensor", TensorData.of(value).to_wire()]
    if isinstance(value, _SCALARS):
        if isinstance(value, int) and not isinstance(value, bool) and not -2**63 <= value < 2**63:
            raise TypeError(f"{where}: an int outside 64 bits cannot be saved")
        return ["value", value]
    if isinstance(value, (list, tuple)):
        return ["tuple" if isinstance(value, tuple) else "list",
                [encode_value(v, f"{where}[{i}]") for i, v in enumerate(value)]]
    if isinstance(value, dict):
        bad = next((k for k in value if not isinstance(k, str)), None)
        if bad is not None:
            raise TypeError(f"{where}: dict key {bad!r} is not a str")
        return ["dict", {k: encode_value(v, f"{where}[{k!r}]") for k, v in value.items()}]
    raise TypeError(f"{where} is a {type(value).__module__}.{type(value).__qualname__}; a saved value is {SAVEABLE}")


def decode_value(enc) -> Any:
    if not isinstance(enc, (list, tuple)) or len(enc) != 2:
        raise ProtocolError(f"saved value: expected [kind, payload], got {type(enc).__name__}")
    kind, payload = enc
    if kind == "tensor":
        return TensorData.from_wire(payload).tensor()
    if kind == "value":
        return payload
    if kind in ("list", "tuple"):
        items = [decode_value(v) for v in payload]
        return tuple(items) if kind == "tuple" else items
    if kind == "dict":
        return {k: decode_value(v) for k, v in payload.items()}
    raise ProtocolError(f"saved value of unknown kind {kind!r}")


@dataclass(frozen=True)
class BlockFailure:
    """A block's exception as words: its type's module and qualified name, its arguments when
    they are plain values, its message and the worker's traceback. The caller gets the
    exception back as its own type when that class is loaded in the caller's process (by
    module and name; nothing is imported or unpickled), else as `tapc.errors.BlockFailed`."""

    block: str
    point: str
    module: str
    qualname: str
    message: str
    traceback: str
    args: tuple | None = None      # None: not all plain values; the type is rebuilt from the message

    @classmethod
    def capture(cls, block: str, point: str, exc: BaseException) -> "BlockFailure":
        args = tuple(exc.args) if all(isinstance(a, (type(None), bool, int, float, str)) for a in exc.args) else None
        return cls(block, point, type(exc).__module__, type(exc).__qualname__, str(exc),
                   "".join(traceback.format_exception(exc)), args)

    @property
    def type_name(self) -> str:
        return f"{self.module}.{self.qualname}"

    def exception_for_caller(self) -> BaseException:
        """The exception, with the worker's traceback in its notes."""
        from tapc.errors import BlockFailed

        exc = None
        cls = _loaded_class(self.module, self.qualname)
        if cls is not None:
            try:
                exc = cls(*self.args) if self.args is not None else cls(self.message)
            except Exception:   # a constructor that wants other arguments: keep the words
                exc = None
        if exc is None:
            exc = BlockFailed(f"{self.type_name}: {self.message}")
        exc.add_note(f"in tapc block `{self.block}` at {self.point}; worker traceback:\n{self.traceback}")
        return exc

    def to_wire(self) -> dict:
        return {"block": self.block, "point": self.point, "module": self.module, "qualname": self.qualname,
                "message": self.message, "traceback": self.traceback,
                "args": None if self.args is None else list(self.args)}

    @classmethod
    def from_wire(cls, d) -> "BlockFailure":
        what = "block failure"
        args = d.get("args")
        return cls(*(wire_field(d, k, str, what) for k in ("block", "point", "module", "qualname", "message", "traceback")),
                   None if args is None else tuple(args))


def _loaded_class(module: str, qualname: str) -> type | None:
    """An exception class by name among the modules the caller has loaded already."""
    obj = sys.modules.get(module)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, type) and issubclass(obj, BaseException) else None


# ----------------------------------------------------------------------------- results


@dataclass(frozen=True)
class Chunk:
    """Rows `[rows, keys, width]` of one capture group at a byte offset of an arena file; or,
    from a GPU on another node than the API (whose arena files the API cannot map), the
    `written` rows themselves in `data` (no file: the worker has freed the block already)."""

    path: str
    offset: int
    rows: int          # allocated
    written: int
    data: bytes | None = None

    def to_wire(self) -> list:
        return [self.path, self.offset, self.rows, self.written] + ([] if self.data is None else [self.data])

    @classmethod
    def from_wire(cls, c) -> "Chunk":
        if not isinstance(c, (list, tuple)) or len(c) not in (4, 5):
            raise ProtocolError(f"a capture chunk is [path, offset, rows, written(, bytes)], not {c!r:.80}")
        data = c[4] if len(c) == 5 else None
        if data is not None and not isinstance(data, bytes):
            raise ProtocolError(f"a capture chunk's rows are bytes, not {type(data).__name__}")
        return cls(str(c[0]), int(c[1]), int(c[2]), int(c[3]), data)


@dataclass(frozen=True)
class StoreResult:
    """A request's captures of one width and dtype: its chunks, in row order."""

    keys: tuple[str, ...]
    dtype: str
    width: int         # the writing GPU's local width (the single-GPU width unless the keys are sharded)
    rows: int          # rows written in all
    chunks: tuple[Chunk, ...]
    rank: int = 0      # tensor-parallel rank of the GPU that wrote it (tapc/plan/sharding.py places its columns)

    def to_wire(self) -> dict:
        return {"keys": list(self.keys), "dtype": self.dtype, "width": self.width, "rows": self.rows,
                "chunks": [c.to_wire() for c in self.chunks], "rank": self.rank}

    @classmethod
    def from_wire(cls, d) -> "StoreResult":
        what = "capture store"
        chunks = tuple(Chunk.from_wire(c) for c in wire_field(d, "chunks", (list, tuple), what))
        return cls(tuple(wire_field(d, "keys", (list, tuple), what)), wire_field(d, "dtype", str, what),
                   wire_field(d, "width", int, what), wire_field(d, "rows", int, what), chunks, wire_field(d, "rank", int, what))


@dataclass(frozen=True)
class Result:
    """What the worker hands back for one request. `error`: why its taps were not served (it
    then has nothing else); the chunks of `stores` belong to the API from now on. `unknown`:
    the worker never had the request (with `error` saying so): under data parallelism another
    engine ran it."""

    id: str
    error: str | None = None
    stores: tuple[StoreResult, ...] = ()
    engine: Mapping[str, TensorData] = field(default_factory=dict)    # logits / samples rows
    saved: Mapping[str, tuple] = field(default_factory=dict)          # name -> encoded values, one per save
    block_error: BlockFailure | None = None
    unknown: bool = False

    def to_wire(self) -> dict:
        return {"id": self.id, "error": self.error, "stores": [s.to_wire() for s in self.stores],
                "engine": {k: t.to_wire() for k, t in self.engine.items()},
                "saved": {k: list(v) for k, v in self.saved.items()},
                "block_error": None if self.block_error is None else self.block_error.to_wire(),
                "unknown": self.unknown}

    @classmethod
    def from_wire(cls, d) -> "Result":
        what = "tapc result"
        error, block_error = d.get("error"), d.get("block_error")
        return cls(wire_field(d, "id", str, what), error if error is None else str(error),
                   tuple(StoreResult.from_wire(s) for s in wire_field(d, "stores", (list, tuple), what)),
                   {k: TensorData.from_wire(t) for k, t in wire_field(d, "engine", Mapping, what).items()},
                   {k: tuple(v) for k, v in wire_field(d, "saved", Mapping, what).items()},
                   None if block_error is None else BlockFailure.from_wire(block_error), bool(d.get("unknown")))

    def saved_values(self) -> dict[str, list]:
        return {k: [decode_value(v) for v in vs] for k, vs in self.saved.items()}


@dataclass(frozen=True)
class CollectReply:
    results: tuple[Result, ...]
    # NaN / inf values in every capture this worker has copied out since a harvest asked it to
    # count (`tapc_count_nonfinite`); None when it does not count.
    nonfinite: int | None = None

    def to_wire(self) -> dict:
        return {"version": VERSION, "results": [r.to_wire() for r in self.results], "nonfinite": self.nonfinite}

    @classmethod
    def from_wire(cls, d) -> "CollectReply":
        _check_version(d, "tapc collect reply")
        return cls(tuple(Result.from_wire(r) for r in wire_field(d, "results", (list, tuple), "tapc collect reply")),
                   wire_field(d, "nonfinite", (int, type(None)), "tapc collect reply"))

    def by_id(self) -> dict[str, Result]:
        return {r.id: r for r in self.results}
