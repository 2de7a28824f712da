"""The CUDA driver's graph calls the engine makes itself (switch.py), through ctypes.

torch exposes a CUDA graph's handles (`raw_cuda_graph`, `raw_cuda_graph_exec`) but none of
the calls that look inside one: which node a launch made during capture, a kernel node's
function, enabling a node of an instantiated graph, or a copy of a graph without some nodes.
Loaded from libcuda with `ctypes.PyDLL` (each call is a few microseconds and keeps the GIL,
like memcpy.py's batched copy); `Driver.load()` is None where the driver lacks them (older than
CUDA 12.3).
"""
from __future__ import annotations

import ctypes

from tapc.errors import EngineError

_CAPTURE_ACTIVE = 1          # CU_STREAM_CAPTURE_STATUS_ACTIVE
_KERNEL_NODE = 0             # CU_GRAPH_NODE_TYPE_KERNEL
_AUTO_FREE_ON_LAUNCH = 1     # CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH


class Driver:
    """libcuda's graph calls, bound once (`load`)."""

    def __init__(self, lib):
        vp, p = ctypes.c_void_p, ctypes.POINTER
        self._v3 = hasattr(lib, "cuStreamGetCaptureInfo_v3")
        self._info = bind(lib.cuStreamGetCaptureInfo_v3 if self._v3 else lib.cuStreamGetCaptureInfo_v2,
                         [vp, p(ctypes.c_int), p(ctypes.c_uint64), p(vp), p(p(vp))] + ([p(vp)] if self._v3 else [])
                         + [p(ctypes.c_size_t)])
        self._type = bind(lib.cuGraphNodeGetType, [vp, p(ctypes.c_int)])
        params = getattr(lib, "cuGraphKernelNodeGetParams_v2", None) or lib.cuGraphKernelNodeGetParams
        self._params = bind(params, [vp, vp])
        self._name = bind(lib.cuFuncGetName, [p(ctypes.c_char_p), vp])
        self._set = bind(lib.cuGraphNodeSetEnabled, [vp, vp, ctypes.c_uint])
        self._get = bind(lib.cuGraphNodeGetEnabled, [vp, vp, p(ctypes.c_uint)])
        self._names: dict[int, str | None] = {}   # function handle -> its name
        # a graph without some of its nodes (`without`): the _v2 calls take edge data (None)
        self._clone = bind(lib.cuGraphClone, [p(vp), vp])
        self._find = bind(lib.cuGraphNodeFindInClone, [p(vp), vp, vp])
        edges = hasattr(lib, "cuGraphNodeGetDependencies_v2")
        self._edges = edges
        self._deps = bind(lib.cuGraphNodeGetDependencies_v2 if edges else lib.cuGraphNodeGetDependencies,
                         [vp, p(vp)] + ([vp] if edges else []) + [p(ctypes.c_size_t)])
        self._dependents = bind(lib.cuGraphNodeGetDependentNodes_v2 if edges else lib.cuGraphNodeGetDependentNodes,
                               [vp, p(vp)] + ([vp] if edges else []) + [p(ctypes.c_size_t)])
        self._add = bind(lib.cuGraphAddDependencies_v2 if edges else lib.cuGraphAddDependencies,
                        [vp, p(vp), p(vp)] + ([vp] if edges else []) + [ctypes.c_size_t])
        self._destroy_node = bind(lib.cuGraphDestroyNode, [vp])
        self._destroy_graph = bind(lib.cuGraphDestroy, [vp])
        self._instantiate = bind(lib.cuGraphInstantiateWithFlags, [p(vp), vp, ctypes.c_ulonglong])
        self._launch = bind(lib.cuGraphLaunch, [vp, vp])
        self._destroy_exec = bind(lib.cuGraphExecDestroy, [vp])

    @classmethod
    def load(cls) -> "Driver | None":
        try:
            return cls(ctypes.PyDLL("libcuda.so.1"))
        except (OSError, AttributeError):
            return None

    def last_node(self, stream: int) -> tuple[int, int] | None:
        """(graph, node) of the one node the stream's next work would follow, while the stream
        captures; None otherwise."""
        status, graph, n = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_size_t()
        deps = ctypes.POINTER(ctypes.c_void_p)()
        extra = [ctypes.byref(ctypes.c_void_p())] if self._v3 else []   # the edges: not read
        err = self._info(ctypes.c_void_p(stream), ctypes.byref(status), ctypes.byref(ctypes.c_uint64()),
                         ctypes.byref(graph), ctypes.byref(deps), *extra, ctypes.byref(n))
        if err != 0 or status.value != _CAPTURE_ACTIVE or n.value != 1:
            return None
        return graph.value, deps[0]

    def kernel_name(self, node: int) -> str | None:
        """The name of a kernel node's function; None for other nodes."""
        kind = ctypes.c_int()
        if self._type(ctypes.c_void_p(node), ctypes.byref(kind)) != 0 or kind.value != _KERNEL_NODE:
            return None
        params = (ctypes.c_uint64 * 16)()    # CUDA_KERNEL_NODE_PARAMS(_v2): the function comes first
        if self._params(ctypes.c_void_p(node), params) != 0 or not params[0]:
            return None
        func = params[0]
        if func not in self._names:   # a graph capture meets the same few functions thousands of times
            name = ctypes.c_char_p()
            ok = self._name(ctypes.byref(name), ctypes.c_void_p(func)) == 0 and name.value
            self._names[func] = name.value.decode() if ok else None
        return self._names[func]

    def without(self, graph: int, nodes) -> int:
        """An instantiated copy of `graph` without `nodes`, each one's predecessors joined to its
        successors, so that the rest keeps its order. EngineError where the driver refuses."""
        clone = ctypes.c_void_p()
        check(self._clone(ctypes.byref(clone), ctypes.c_void_p(graph)), "cuGraphClone")
        try:
            for node in nodes:
                mine = ctypes.c_void_p()
                check(self._find(ctypes.byref(mine), ctypes.c_void_p(node), clone), "cuGraphNodeFindInClone")
                before, after = self._neighbours(self._deps, mine), self._neighbours(self._dependents, mine)
                check(self._destroy_node(mine), "cuGraphDestroyNode")
                pairs = []
                for b in before:
                    has = set(self._neighbours(self._dependents, b))   # an edge it has already is not added
                    pairs += [(b, a) for a in after if a not in has]
                if pairs:
                    frm = (ctypes.c_void_p * len(pairs))(*(b for b, _ in pairs))
                    to = (ctypes.c_void_p * len(pairs))(*(a for _, a in pairs))
                    edge = [None] if self._edges else []
                    check(self._add(clone, frm, to, *edge, len(pairs)), "cuGraphAddDependencies")
            out = ctypes.c_void_p()
            # as torch instantiates its graphs (CUDAGraph::instantiate)
            check(self._instantiate(ctypes.byref(out), clone, _AUTO_FREE_ON_LAUNCH), "cuGraphInstantiateWithFlags")
            return out.value
        finally:
            self._destroy_graph(clone)   # an instantiated graph does not need its graph

    def _neighbours(self, fn, node) -> list[int]:
        n = ctypes.c_size_t()
        edge = [None] if self._edges else []
        check(fn(node, None, *edge, ctypes.byref(n)), "cuGraphNodeGet(Dependencies|DependentNodes)")
        if not n.value:
            return []
        out = (ctypes.c_void_p * n.value)()
        check(fn(node, out, *edge, ctypes.byref(n)), "cuGraphNodeGet(Dependencies|DependentNodes)")
        return list(out[: n.value])

    def launch(self, graph_exec: int, stream: int) -> None:
        check(self._launch(ctypes.c_void_p(graph_exec), ctypes.c_void_p(stream)), "cuGraphLaunch")

    def destroy(self, graph_exec: int) -> None:
        self._destroy_exec(ctypes.c_void_p(graph_exec))

    def set_enabled(self, graph_exec: int, node: int, on: bool) -> int:
        return self._set(ctypes.c_void_p(graph_exec), ctypes.c_void_p(node), int(on))

    def enabled(self, graph_exec: int, node: int) -> bool:
        out = ctypes.c_uint()
        check(self._get(ctypes.c_void_p(graph_exec), ctypes.c_void_p(node), ctypes.byref(out)), "cuGraphNodeGetEnabled")
        return bool(out.value)


def bind(fn, argtypes):
    fn.restype, fn.argtypes = ctypes.c_int, argtypes
    return fn


def check(err: int, call: str) -> None:
    if err != 0:
        raise EngineError(f"{call} failed (CUresult {err})")
