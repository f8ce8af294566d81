"""How a transformers release wires its flash code path, read from the module itself.

transformers' flash path (``modeling_flash_attention_utils``) gets flash-attn's kernel functions
in one of two ways, and the way changes between releases without notice:

* **lazy**: a function ``_lazy_imports(implementation, ...)`` returns a tuple of kernel functions
  and helpers, and a consumer (``lazy_import_flash_attention``, or ``_flash_attention_forward``
  itself) unpacks it into module globals that cache the result (4.54 and later);
* **globals**: the module binds flash-attn's functions as globals at import and its flash path
  (``_flash_attention_forward``) reads them (4.49-4.53).

:func:`read` recognises which, and the details attnguard needs to hand the flash path its SDPA
twins, from the module's *shape* — the names and the source of its functions — never from the
version number: which element of the returned tuple is which function (by the names the release
itself uses for them), the parameter that carries the implementation, the globals that cache the
result, the globals the flash path reads, and the ``window_size`` the flash path passes for a
``sliding_window``. Anything it does not recognise makes it say why instead of guessing; the
behaviour itself is then confirmed by a probe at first use (:mod:`.probe`).

Pure: reads a module object and the source of its functions; imports and changes nothing.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

LAZY, GLOBALS = "lazy", "globals"
LAZY_FUNCTION = "_lazy_imports"

# the roles of the functions transformers gets, by the names releases give them
FUNC, VARLEN, KVCACHE, PAD, UNPAD, INDEX, IS_FA3 = (
    "flash_attn_func",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
    "pad_input",
    "unpad_input",
    "index_first_axis",
    "is_fa3",
)
# a name in _lazy_imports' return statements -> role
_RETURNED_NAMES = {FUNC: FUNC, VARLEN: VARLEN, KVCACHE: KVCACHE, PAD: PAD, UNPAD: UNPAD}
# a name the consumer unpacks the tuple into (leading "_" and a trailing "_fn" dropped) -> role
_UNPACKED_NAMES = {
    "flash": FUNC,
    "flash_varlen": VARLEN,
    "flash_with_kvcache": KVCACHE,
    "flash_kvcache": KVCACHE,
    "pad": PAD,
    "unpad": UNPAD,
    "is_fa3": IS_FA3,
}
# globals layout: a module global the flash path reads -> the role the twins serve
KERNEL_GLOBALS = {
    "flash_attn_func": FUNC,
    "flash_attn_varlen_func": VARLEN,
    "flash_attn_2_func": FUNC,
    "flash_attn_2_varlen_func": VARLEN,
}
PADDING_GLOBALS = {
    "pad_input": PAD,
    "unpad_input": UNPAD,
    "index_first_axis": INDEX,
    "pad_input_fa2": PAD,
    "unpad_input_fa2": UNPAD,
}
# read by the flash path but not flash-attn 2's: the twins never stand in for them
_OTHER_KERNEL_GLOBALS = ("flash_attn_3_func", "flash_attn_3_varlen_func")
_OTHER_KERNEL_GLOBALS += ("pad_input_fa3", "unpad_input_fa3")


@dataclass(frozen=True)
class Wiring:
    """What attnguard needs to know to hand this release's flash path the twins."""

    layout: str  # LAZY or GLOBALS
    # LAZY: the roles of _lazy_imports' returned tuple, in order; its implementation parameter
    # (name, position); the module globals that cache what it returned, and whether the consumer
    # tests them by presence in globals() (then they are removed, not set to None, to re-resolve)
    returns: tuple[str, ...] = ()
    implementation_param: tuple[str, int] = ("implementation", 0)
    caches: tuple[str, ...] = ()
    cached_by_presence: bool = False
    # GLOBALS: the globals the flash path reads that the twins can serve
    kernel_globals: tuple[str, ...] = ()
    # flash's window_size for sliding_window=w, as (left - w, right - w); None: not readable
    window_offset: tuple[int, int] | None = None
    # the parameters of the flash path's own functions: arguments it consumes
    path_parameters: frozenset[str] = frozenset()
    # arguments it hands the kernel only where the kernel's signature declares one of these names
    # (``_process_flash_attention_kwargs``' ``supports_mapping``), else drops: (argument, names)
    conditional: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def window(self, sliding_window: int) -> tuple[int, int] | None:
        if self.window_offset is None:
            return None
        left, right = self.window_offset
        return sliding_window + left, sliding_window + right

    def describe(self) -> str:
        if self.layout == LAZY:
            return f"{LAZY_FUNCTION}() -> ({', '.join(self.returns)})"
        return f"module globals {', '.join(self.kernel_globals)}"


class Unrecognised(Exception):
    """The module's flash wiring is not one attnguard knows; the message says what differs."""


# --- reading source --------------------------------------------------------------------------


def _function_tree(fn: Any) -> ast.FunctionDef:
    """The AST of a module-level function, from its source file."""
    fn = inspect.unwrap(fn)  # our own wrapper of the function reads as the original
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError) as exc:
        raise Unrecognised(f"the source of {getattr(fn, '__name__', fn)} is not readable") from exc
    node = ast.parse(source).body[0]
    if not isinstance(node, ast.FunctionDef):
        raise Unrecognised(f"{getattr(fn, '__name__', fn)} is not a plain function")
    return node


def _module_functions(module: ModuleType) -> list[Callable[..., Any]]:
    name = module.__name__
    return [
        f
        for f in vars(module).values()
        if inspect.isfunction(f) and getattr(f, "__module__", None) == name
    ]


def _calls(node: ast.AST, name: str) -> bool:
    return any(
        isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == name
        for n in ast.walk(node)
    )


# --- the lazy layout ---------------------------------------------------------------------------


def _returned_role(element: ast.expr) -> str:
    if isinstance(element, ast.Name) and element.id in _RETURNED_NAMES:
        return _RETURNED_NAMES[element.id]
    if (
        isinstance(element, ast.Call)
        and isinstance(element.func, ast.Name)
        and element.func.id == "getattr"
        and len(element.args) >= 2
        and isinstance(element.args[1], ast.Constant)
        and element.args[1].value in _RETURNED_NAMES
    ):
        return _RETURNED_NAMES[element.args[1].value]
    if isinstance(element, ast.Constant) and isinstance(element.value, bool):
        return "<flag>"
    raise Unrecognised(f"{LAZY_FUNCTION} returns {ast.unparse(element)!r}, not a known function")


def _returned_roles(tree: ast.FunctionDef) -> tuple[str, ...]:
    shapes = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Return):
            if not isinstance(node.value, ast.Tuple):
                raise Unrecognised(f"{LAZY_FUNCTION} returns something other than a tuple")
            shapes.add(tuple(_returned_role(e) for e in node.value.elts))
    if len(shapes) != 1:
        raise Unrecognised(f"{LAZY_FUNCTION}'s return statements disagree ({len(shapes)} shapes)")
    return shapes.pop()


def _unpacked_role(name: str) -> str:
    key = name.lstrip("_")
    key = key[: -len("_fn")] if key.endswith("_fn") else key
    if key not in _UNPACKED_NAMES:
        raise Unrecognised(f"{LAZY_FUNCTION}'s result is unpacked into {name!r}, not a known role")
    return _UNPACKED_NAMES[key]


def _consumers(module: ModuleType) -> list[ast.FunctionDef]:
    trees = []
    for fn in _module_functions(module):
        if fn.__name__ == LAZY_FUNCTION or LAZY_FUNCTION not in fn.__code__.co_names:
            continue
        trees.append(_function_tree(fn))
    if not trees:
        raise Unrecognised(f"no function of the module calls {LAZY_FUNCTION}")
    return trees


def _unpacked_roles(consumers: list[ast.FunctionDef]) -> tuple[str, ...]:
    shapes = set()
    for tree in consumers:
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Assign) and _calls(node.value, LAZY_FUNCTION)):
                continue
            target = node.targets[0]
            if not (isinstance(target, ast.Tuple) and isinstance(node.value, ast.Call)):
                raise Unrecognised(f"{LAZY_FUNCTION}'s result is not unpacked into names")
            names = [e.id for e in target.elts if isinstance(e, ast.Name)]
            if len(names) != len(target.elts):
                raise Unrecognised(f"{LAZY_FUNCTION}'s result is not unpacked into names")
            shapes.add(tuple(_unpacked_role(n) for n in names))
    if len(shapes) != 1:
        raise Unrecognised(f"{LAZY_FUNCTION}'s result is unpacked in {len(shapes)} different ways")
    return shapes.pop()


def _caches(consumers: list[ast.FunctionDef]) -> tuple[tuple[str, ...], bool]:
    """The globals the consumers keep the result in, and whether they test them by presence in
    ``globals()`` (4.54) rather than by value."""
    names: list[str] = []
    by_presence = False
    for tree in consumers:
        for node in ast.walk(tree):
            if isinstance(node, ast.Global):
                names.extend(node.names)
            elif (
                isinstance(node, ast.Subscript)
                and _calls(node.value, "globals")
                and isinstance(node.slice, ast.Constant)
                and isinstance(node.slice.value, str)
            ):
                names.append(node.slice.value)
            elif (
                isinstance(node, ast.Compare)
                and any(isinstance(op, ast.In) for op in node.ops)
                and any(_calls(c, "globals") for c in node.comparators)
            ):
                by_presence = True
    if not names:
        raise Unrecognised(f"no global caches what {LAZY_FUNCTION} returns")
    return tuple(dict.fromkeys(names)), by_presence


def _implementation_param(tree: ast.FunctionDef) -> tuple[str, int]:
    params = tree.args.posonlyargs + tree.args.args
    if not params or "impl" not in params[0].arg:
        raise Unrecognised(f"{LAZY_FUNCTION}'s first parameter is not the implementation")
    return params[0].arg, 0


def _read_lazy(module: ModuleType, lazy: Callable[..., Any]) -> Wiring:
    tree = _function_tree(lazy)
    returns = _returned_roles(tree)
    consumers = _consumers(module)
    unpacked = _unpacked_roles(consumers)
    if len(unpacked) != len(returns) or any(
        r != u and not (r == "<flag>" and u == IS_FA3)
        for r, u in zip(returns, unpacked, strict=True)
    ):
        raise Unrecognised(
            f"{LAZY_FUNCTION} returns ({', '.join(returns)}) but its result is unpacked as "
            f"({', '.join(unpacked)})"
        )
    if FUNC not in unpacked or VARLEN not in unpacked:
        raise Unrecognised(f"{LAZY_FUNCTION} does not return both flash-attn kernel functions")
    caches, by_presence = _caches(consumers)
    return Wiring(
        LAZY,
        returns=unpacked,
        implementation_param=_implementation_param(tree),
        caches=caches,
        cached_by_presence=by_presence,
        window_offset=_window_offset(module),
        path_parameters=_path_parameters(module),
        conditional=_conditional(module),
    )


# --- the globals layout ------------------------------------------------------------------------


def _read_globals(module: ModuleType) -> Wiring:
    """The flash path reads module globals bound to flash-attn's functions (whatever its
    functions are called): which ones, and that the twins can stand for every kernel it reads."""
    read: set[str] = set()
    for fn in _module_functions(module):
        read.update(fn.__code__.co_names)
    kernels = {n for n in read if n in KERNEL_GLOBALS}
    roles = {KERNEL_GLOBALS[n] for n in kernels}
    if roles != {FUNC, VARLEN}:
        raise Unrecognised(
            "no function of the module reads flash-attn kernel functions it can be given"
        )
    unknown = sorted(
        n
        for n in read
        if n.startswith(("flash_attn_", "pad_input", "unpad_input"))
        and n not in KERNEL_GLOBALS
        and n not in PADDING_GLOBALS
        and n not in _OTHER_KERNEL_GLOBALS
        and not callable(vars(module).get(n))  # a helper the release defines itself
    )
    if unknown:
        raise Unrecognised(
            f"the flash path reads kernel globals attnguard does not know: {unknown}"
        )
    names = sorted(n for n in read if n in KERNEL_GLOBALS or n in PADDING_GLOBALS)
    return Wiring(
        GLOBALS,
        kernel_globals=tuple(names),
        window_offset=_window_offset(module),
        path_parameters=_path_parameters(module),
        conditional=_conditional(module),
    )


# --- the window convention ---------------------------------------------------------------------


def _offset(expr: ast.expr) -> int | None:
    """``sliding_window`` -> 0, ``sliding_window - 1`` -> -1, ``sliding_window + k`` -> k."""
    if isinstance(expr, ast.Name) and expr.id == "sliding_window":
        return 0
    if (
        isinstance(expr, ast.BinOp)
        and isinstance(expr.left, ast.Name)
        and expr.left.id == "sliding_window"
        and isinstance(expr.right, ast.Constant)
        and isinstance(expr.right.value, int)
        and isinstance(expr.op, (ast.Add, ast.Sub))
    ):
        return expr.right.value if isinstance(expr.op, ast.Add) else -expr.right.value
    return None


def _window_offset(module: ModuleType) -> tuple[int, int] | None:
    """The (left, right) window_size the flash path builds from ``sliding_window``, as offsets,
    where the module spells it as a tuple next to the key "window_size"; None otherwise (the
    probe records it then)."""
    found = set()
    for fn in _module_functions(module):
        if "sliding_window" not in fn.__code__.co_varnames:
            continue
        try:
            tree = _function_tree(fn)
        except Unrecognised:
            continue
        for node in ast.walk(tree):
            pairs: list[tuple[ast.expr | None, ast.expr]] = []
            if isinstance(node, ast.Dict):
                pairs = list(zip(node.keys, node.values, strict=True))
            elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Subscript):
                pairs = [(node.targets[0].slice, node.value)]
            for key, value in pairs:
                if not (isinstance(key, ast.Constant) and key.value == "window_size"):
                    continue
                if isinstance(value, ast.Tuple) and len(value.elts) == 2:
                    left, right = (_offset(e) for e in value.elts)
                    if left is not None and right is not None:
                        found.add((left, right))
    return found.pop() if len(found) == 1 else None


# --- the arguments it consumes ----------------------------------------------------------------

FORWARD_FUNCTION = "_flash_attention_forward"
PROCESS_FUNCTION = "_process_flash_attention_kwargs"


def _named_parameters(fn: Any) -> set[str]:
    """The named parameters of ``fn`` (not ``*args`` / ``**kwargs``)."""
    try:
        params = inspect.signature(inspect.unwrap(fn)).parameters.values()
    except (TypeError, ValueError):
        return set()
    return {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}


def _path_parameters(module: ModuleType) -> frozenset[str]:
    """The parameters of the flash path's own functions: every argument a call can pass them
    that they read (anything else ends in a ``**kwargs`` they never read)."""
    names: set[str] = set()
    for name in (FORWARD_FUNCTION, PROCESS_FUNCTION):
        fn = vars(module).get(name)
        if callable(fn):
            names |= _named_parameters(fn)
    return frozenset(names - {"kwargs", "supports_mapping"})


def _conditional(module: ModuleType) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The arguments the release hands the kernel only where its signature has them: the keys
    ``_process_flash_attention_kwargs`` reads from ``supports_mapping``, traced back to the
    argument through the release's own name maps (``dropout`` -> ``dropout_p``, ``s_aux`` ->
    ``s_aux`` or ``learnable_sink``, ...)."""
    process = vars(module).get(PROCESS_FUNCTION)
    if not callable(process):
        return ()
    try:
        tree = _function_tree(process)
    except Unrecognised:
        return ()
    keys = {
        node.slice.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Subscript)
        and isinstance(node.value, ast.Name)
        and node.value.id == "supports_mapping"
        and isinstance(node.slice, ast.Constant)
        and isinstance(node.slice.value, str)
    }
    renamed = vars(module).get("_hf_api_to_flash_mapping") or {}
    alternatives = vars(module).get("_flash_api_alternative_names") or {}
    out = []
    for param in sorted(_named_parameters(process)):
        names = {renamed.get(param, param), alternatives.get(param, param)}
        found = tuple(sorted(n for n in names if n in keys))
        if found:
            out.append((param, found))
    return tuple(out)


# --- entry -------------------------------------------------------------------------------------


def read(module: ModuleType) -> Wiring:
    """The flash wiring of ``module`` (transformers' ``modeling_flash_attention_utils``).
    Raises :class:`Unrecognised` with the reason when it is not one attnguard knows."""
    lazy = vars(module).get(LAZY_FUNCTION)
    if lazy is not None:
        if not callable(lazy):
            raise Unrecognised(f"{LAZY_FUNCTION} is not a function")
        return _read_lazy(module, lazy)
    try:
        return _read_globals(module)
    except Unrecognised as exc:
        raise Unrecognised(f"it has no {LAZY_FUNCTION}, and {exc}") from None
