"""Mixed-precision policy: the level, the low dtype and the effective op categories.

A :class:`Policy` is frozen data. The AMP pass only reads it; variants come from
``dataclasses.replace`` or :meth:`Policy.for_level`.

Level semantics (Paddle ``paddle.amp`` and MindSpore ``amp``):

=====  =====================================================================================
O0     no change (but a low model's ops TVM cannot run low compute in fp32)
O1     white ops low, black ops fp32, other ops low only when all their float inputs are low
O2     every op low except the black list and ops without low-precision support on the target;
       a follow op that only feeds fp32 ops and reads an fp32 value stays fp32 (no round trip)
O3     every op low
OD     only white ops low, everything else fp32
auto   white low, black fp32, promote ops in the widest input dtype, other ops keep the dtype
       of their inputs (MindSpore ``amp_level="auto"``)
=====  =====================================================================================
"""

from __future__ import annotations

import collections
import dataclasses
import difflib
import enum
import fnmatch
import warnings
from collections.abc import Iterable, Sequence

import tvm

from . import op_lists
from .tensors import FLOAT_DTYPES

LEVELS = ("O0", "O1", "O2", "O3", "OD", "auto")
LOW_DTYPES = ("float16", "bfloat16")


class Category(str, enum.Enum):
    """Where an op sits in the default lists."""

    WHITE = "white"
    BLACK = "black"
    FOLLOW = "follow"
    PROMOTE = "promote"
    FIXED = "fixed"


# Each category's default members are the op_lists tuple of the same name.
DEFAULT_CATEGORIES: dict[str, Category] = {
    name: category for category in Category for name in getattr(op_lists, category.name)
}


def check_level(level: str, component: str = "tvmamp") -> str:
    """Return ``level`` if it is a known level, else raise ValueError naming the choices."""
    if level not in LEVELS:
        raise ValueError(f"{component}: level {level!r} is not one of {', '.join(LEVELS)}")
    return level


def check_dtype(dtype: str, component: str = "tvmamp") -> str:
    """Return ``dtype`` if it is a supported low dtype, else raise ValueError."""
    if dtype not in LOW_DTYPES:
        raise ValueError(f"{component}: dtype {dtype!r} is not one of {', '.join(LOW_DTYPES)}")
    return dtype


class UnmappedOpWarning(UserWarning):
    """A framework op name in a custom list has no Relax op, so listing it changes nothing."""


def _registered_relax_ops() -> set[str]:
    return {name for name in tvm.ir.Op.list_op_names() if name.startswith("relax.")}


def _relax_name_index() -> dict[str, str]:
    """Lower-case spellings of every Relax op -> its name.

    A Relax op is known by its full name (``relax.nn.softmax``), the name without ``relax.``
    (``nn.softmax``) and its last part (``softmax``) when no other op shares that last part.
    """
    registered = sorted(_registered_relax_ops())
    last_parts = collections.Counter(n.rsplit(".", 1)[1] for n in registered)
    index: dict[str, str] = {}
    for name in registered:
        index[name] = name
        index.setdefault(name[len("relax.") :], name)
        last = name.rsplit(".", 1)[1]
        if last_parts[last] == 1:
            index.setdefault(last, name)
    return index


def _lookup(name: str, index: dict[str, str]) -> tuple[str, ...] | None:
    """The Relax ops a user op name stands for, or None; case-insensitive."""
    key = name.lower()
    if key in index:
        return (index[key],)
    return op_lists.OP_ALIASES.get(key)


def resolve_op_names(names: Iterable[str], component: str = "tvmamp") -> set[str]:
    """Map user op names (Relax names or Paddle/MindSpore/PyTorch names) to Relax op names.

    Names match case-insensitively: ``"Exp"``, ``"exp"`` and ``"relax.exp"`` are one op. A name
    from a framework's AMP lists that has no Relax op (``op_lists.NO_RELAX_OP``: the RNN cells,
    some losses) is accepted with one :class:`UnmappedOpWarning` naming it, and changes nothing.

    Raises
    ------
    ValueError
        For a name that is neither a Relax op, a known alias nor a framework op name; the
        message lists the closest matches.
    """
    if isinstance(names, str):
        raise TypeError(f"{component}: expected a list of op names, got the string {names!r}")
    names = list(names)
    if not names:
        return set()
    index = _relax_name_index()
    no_relax_op = {n.lower() for n in op_lists.NO_RELAX_OP}
    resolved: set[str] = set()
    unmapped: dict[str, str] = {}  # lower-case name -> the name as the user wrote it
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"{component}: op names must be strings, got {name!r}")
        ops = _lookup(name, index)
        if ops is not None:
            resolved.update(ops)
        elif name.lower() in no_relax_op:
            unmapped.setdefault(name.lower(), name)
        else:
            choices = sorted({*index, *op_lists.OP_ALIASES, *no_relax_op})
            close = difflib.get_close_matches(name.lower(), choices, n=5, cutoff=0.5)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ValueError(f"{component}: unknown op name {name!r}{hint}")
    for name in unmapped.values():
        _warn_unmapped(name, component)
    return resolved


def _warn_unmapped(name: str, component: str) -> None:
    warnings.warn(
        f"{component}: {name!r} is a framework op with no Relax op of its own (TVM imports it "
        "as other ops, or not at all); it is ignored, and the ops a model imports it as keep "
        "their own categories",
        UnmappedOpWarning,
        stacklevel=4,
    )


@dataclasses.dataclass(frozen=True)
class Policy:
    """Which dtype each op computes in.

    Parameters
    ----------
    level : str
        One of ``LEVELS``.
    low_dtype : str
        ``"float16"`` or ``"bfloat16"``.
    categories : dict
        Relax op name to :class:`Category`, after the user's list edits and target overrides.
    accumulate_dtype : str
        ``out_dtype`` given to matmul/conv when they run low.
    fp32_nodes, low_nodes : tuple of str
        Glob patterns on binding or parameter names that force a node to fp32 or to low.
    node_dtypes : dict
        Exact per-node assignment, node id (``"main/lv3"``, see ``AmpReport.nodes``) ->
        ``"float32"`` or ``"low"``. It wins over every other rule but the overflow guard and
        ``unsupported``; a precision plan is applied through it.
    unsupported : frozenset of str
        Ops with no ``low_dtype`` kernel (on the target, or in TVM for bfloat16): fp32 at every
        level and whatever the per-node rules say.
    fp32_feeds : bool
        O2 only: a follow op whose result only feeds fp32 ops and that reads an fp32 value runs
        in fp32 (no round trip through the low dtype). The target entry decides; an fp16-only
        NPU turns it off.
    """

    level: str
    low_dtype: str
    categories: dict = dataclasses.field(default_factory=lambda: dict(DEFAULT_CATEGORIES))
    accumulate_dtype: str = "float32"
    fp32_nodes: tuple = ()
    low_nodes: tuple = ()
    node_dtypes: dict = dataclasses.field(default_factory=dict)
    unsupported: frozenset = frozenset()
    fp32_feeds: bool = True

    @classmethod
    def for_level(
        cls,
        level: str = "O1",
        dtype: str = "float16",
        *,
        custom_white_list: Sequence[str] | None = None,
        custom_black_list: Sequence[str] | None = None,
        custom_fp32_nodes: Sequence[str] | None = None,
        custom_low_nodes: Sequence[str] | None = None,
        unsupported_low_ops: Iterable[str] = (),
        accumulate_dtype: str = "float32",
        node_dtypes: dict | None = None,
        fp32_feeds: bool = True,
    ) -> Policy:
        """Build the policy for a level, with the user's list edits and the target's limits.

        ``unsupported_low_ops`` comes from the target entry: ops that cannot run in ``dtype``
        there. They, and the ops TVM cannot lower in bfloat16 (``op_lists.NO_BFLOAT16``), are
        moved to the black list and stay fp32 at every level, O3 included.
        """
        check_level(level, "tvmamp.Policy")
        check_dtype(dtype, "tvmamp.Policy")
        if accumulate_dtype not in FLOAT_DTYPES:
            raise ValueError(
                f"tvmamp.Policy: accumulate_dtype {accumulate_dtype!r} is not one of "
                f"{', '.join(FLOAT_DTYPES)}"
            )
        white = resolve_op_names(custom_white_list or (), "tvmamp.Policy custom_white_list")
        black = resolve_op_names(custom_black_list or (), "tvmamp.Policy custom_black_list")
        both = white & black
        if both:
            raise ValueError(
                f"tvmamp.Policy: {', '.join(sorted(both))} is in both custom_white_list and "
                "custom_black_list"
            )
        categories = dict(DEFAULT_CATEGORIES)
        for name in sorted(white | black):
            if categories.get(name) is Category.FIXED:
                raise ValueError(
                    f"tvmamp.Policy: {name} has a fixed dtype (not a float compute op) and cannot "
                    "be put on the white or black list"
                )
            categories[name] = Category.WHITE if name in white else Category.BLACK
        unsupported = frozenset(unsupported_low_ops) | frozenset(
            op_lists.NO_BFLOAT16 if dtype == "bfloat16" else ()
        )
        forced_low = sorted(white & unsupported)
        if forced_low:
            raise ValueError(
                f"tvmamp.Policy: {', '.join(forced_low)} cannot run in {dtype} on this target "
                "and cannot be put on the white list; keep it fp32 or choose another dtype"
            )
        for name in unsupported:
            categories[name] = Category.BLACK
        return cls(
            level=level,
            low_dtype=dtype,
            categories=categories,
            accumulate_dtype=accumulate_dtype,
            fp32_nodes=_check_patterns(custom_fp32_nodes, "custom_fp32_nodes"),
            low_nodes=_check_patterns(custom_low_nodes, "custom_low_nodes"),
            node_dtypes=_check_node_dtypes(node_dtypes),
            unsupported=unsupported,
            fp32_feeds=bool(fp32_feeds),
        )

    def category(self, op_name: str) -> Category:
        """Category of ``op_name``; ops not in the registry lists (new ops) follow."""
        return self.categories.get(op_name, Category.FOLLOW)

    def compute_dtype(self, op_name: str, input_dtypes: Sequence[str]) -> str | None:
        """The dtype ``op_name`` computes in, given the (nominal) dtypes of its float inputs.

        Returns None when the op must not be changed: fixed ops, no float inputs, and at O0
        every op but one TVM cannot run in the low dtype given low inputs (a bf16 model's sort).
        """
        category = self.category(op_name)
        if self.level == "O0":  # as written, but a low model's op TVM cannot run low: fp32
            unsupported = op_name in self.unsupported and self.low_dtype in input_dtypes
            return "float32" if unsupported and category is not Category.FIXED else None
        if category is Category.FIXED or not input_dtypes:
            return None
        if op_name in self.unsupported:
            return "float32"
        low = self.low_dtype
        widest = "float32" if any(d == "float32" for d in input_dtypes) else low
        if self.level == "O3":
            return low
        if category is Category.WHITE:
            return low
        if category is Category.BLACK or self.level == "OD":
            return "float32"
        if category is Category.PROMOTE or self.level in ("O1", "auto"):
            return widest
        return low  # O2: follow ops run low

    def node_override(self, names: Iterable[str], node_id: str | None = None) -> str | None:
        """Per-node dtype forced by ``node_dtypes`` (exact id) or ``fp32_nodes``/``low_nodes``."""
        exact = self.node_dtypes.get(node_id) if node_id else None
        if exact is not None:
            return "float32" if exact == "float32" else self.low_dtype
        names = [n for n in names if n]
        if any(fnmatch.fnmatchcase(n, p) for n in names for p in self.fp32_nodes):
            return "float32"
        if any(fnmatch.fnmatchcase(n, p) for n in names for p in self.low_nodes):
            return self.low_dtype
        return None

    def ops_in(self, *wanted: Category) -> tuple[str, ...]:
        """Sorted op names whose category is one of ``wanted``."""
        return tuple(sorted(n for n, c in self.categories.items() if c in wanted))

    def white_list(self) -> tuple[str, ...]:
        """The white list at this level: ops that run low whatever their inputs.

        The ``Category.WHITE`` ops, except at O0 (none) and O3 (every float op).
        """
        float_ops = (Category.WHITE, Category.BLACK, Category.FOLLOW, Category.PROMOTE)
        return {
            "O0": (),
            "O3": self.ops_in(*float_ops),
        }.get(self.level, self.ops_in(Category.WHITE))

    def black_list(self) -> tuple[str, ...]:
        """The black list at this level: ops that run in fp32 whatever their inputs.

        The ``Category.BLACK`` ops, except at O0 (every float op), O3 (none) and OD (every
        float op but the white ones).
        """
        non_white = (Category.BLACK, Category.FOLLOW, Category.PROMOTE)
        return {
            "O0": self.ops_in(Category.WHITE, *non_white),
            "O3": (),
            "OD": self.ops_in(*non_white),
        }.get(self.level, self.ops_in(Category.BLACK))


def _check_patterns(patterns: Sequence[str] | None, what: str) -> tuple:
    if patterns is None:
        return ()
    if isinstance(patterns, str):
        raise TypeError(f"tvmamp.Policy: {what} must be a list of glob patterns, not a string")
    for p in patterns:
        if not isinstance(p, str) or not p:
            raise TypeError(f"tvmamp.Policy: {what} entries must be non-empty strings, got {p!r}")
    return tuple(patterns)


def _check_node_dtypes(node_dtypes: dict | None) -> dict:
    if node_dtypes is None:
        return {}
    if not isinstance(node_dtypes, dict):
        raise TypeError(f"tvmamp.Policy: node_dtypes must be a dict, got {node_dtypes!r}")
    choices = ("float32", "low", *LOW_DTYPES)
    for node, dtype in node_dtypes.items():
        if dtype not in choices:
            raise ValueError(
                f"tvmamp.Policy: node {node!r} has dtype {dtype!r}; "
                f"choose from {', '.join(choices)}"
            )
    return dict(node_dtypes)
