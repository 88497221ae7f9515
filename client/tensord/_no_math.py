"""What a torch user's first ``x + 1`` or ``x.sum()`` on a tensord Tensor says.

A tensord Tensor stores, views and moves a tensor; the math runs where its values are
brought.  Without the methods here Python would say only "unsupported operand type(s)"
or "no attribute 'sum'", which reads as a missing feature rather than a design.

The error types are the ones Python itself raises, as torch users meet them: TypeError
for an operator (``x + 1``, ``-x``, ``x += 1``, ``x < 0``), AttributeError for a math
method (``x.sum()``, ``x.add_(1)``: ``hasattr(x, "sum")`` stays False for code that
tests for one).  An operator with a NumPy operand returns NotImplemented, so NumPy
computes with the values it downloads (``x + np.ones(3)`` is an ndarray), as without
these methods; an in-place one refuses it too, since ``x += a`` would rebind ``x`` to
an ndarray.  ``==`` and ``!=`` keep Python's identity meaning: tensors are dict keys
and set members.  Type checkers see none of this (``x + 1`` stays a type error there).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np

from tensord import errors

#: what every refusal here adds to Python's own words
NO_MATH = (
    "tensord stores, views and moves tensors but does no math on them; compute on the "
    "values (x.numpy(), or torch.from_dlpack(x) without a copy on the server's host), then "
    "write the result back with x.copy_(result)"
)

# torch.Tensor's math methods a torch user reaches for (tests check each is torch's and
# none is tensord's); any other missing name keeps Python's plain AttributeError.
_MATH_NAMES = """
    abs abs_ absolute absolute_ acos acos_ acosh acosh_ add add_ addbmm addbmm_ addcdiv
    addcdiv_ addcmul addcmul_ addmm addmm_ addmv addmv_ addr addr_ all allclose amax amin
    aminmax angle any arccos arccos_ arcsin arcsin_ arctan arctan2 arctan_ argmax argmin
    argsort argwhere asin asin_ atan atan2 atan2_ atan_ baddbmm baddbmm_ bincount
    bitwise_and bitwise_and_ bitwise_not bitwise_not_ bitwise_or bitwise_or_ bitwise_xor
    bitwise_xor_ bmm ceil ceil_ clamp clamp_ clamp_max clamp_max_ clamp_min clamp_min_ clip
    clip_ cos cos_ cosh cosh_ count_nonzero cross cummax cummin cumprod cumprod_ cumsum
    cumsum_ det diag diff dist div div_ divide divide_ dot eq eq_ equal erf erf_ exp exp2
    exp2_ exp_ expm1 expm1_ flip fliplr flipud floor floor_ floor_divide floor_divide_ fmax
    fmin fmod fmod_ frac frac_ gather ge ge_ greater greater_equal gt gt_ histc hypot inner
    inverse isclose isfinite isinf isnan kthvalue le le_ lerp lerp_ less less_equal lgamma
    log log10 log10_ log1p log1p_ log2 log2_ log_ log_softmax logaddexp logical_and
    logical_and_ logical_not logical_not_ logical_or logical_or_ logical_xor logical_xor_
    logsumexp lt lt_ matmul max maximum mean median min minimum mm mode mul mul_ multiply
    multiply_ mv nan_to_num nan_to_num_ nanmean nanmedian nansum ne ne_ neg neg_ negative
    negative_ nonzero norm not_equal outer pow pow_ prod quantile reciprocal reciprocal_
    relu relu_ remainder remainder_ roll round round_ rsqrt rsqrt_ sigmoid sigmoid_ sign
    sign_ sin sin_ sinh sinh_ softmax sort sqrt sqrt_ square square_ std sub sub_ subtract
    subtract_ sum tan tan_ tanh tanh_ topk trace tril tril_ triu triu_ true_divide
    true_divide_ trunc trunc_ unique var where xlogy xlogy_
"""
MATH_METHODS = frozenset(_MATH_NAMES.split())


def _type_name(value: Any) -> str:
    kind = type(value)
    if isinstance(value, NoMath):
        return "tensord.Tensor"
    if kind.__module__ == "builtins":
        return kind.__qualname__
    return f"{kind.__module__.partition('.')[0]}.{kind.__qualname__}"


def _binary(symbol: str, *, reflected: bool = False, in_place: bool = False) -> Callable[..., Any]:
    def refuse(self: NoMath, other: Any) -> Any:
        if not in_place and isinstance(other, (np.ndarray, np.generic)):
            return NotImplemented  # NumPy's turn: it computes with the downloaded values
        left, right = (other, self) if reflected else (self, other)
        raise errors.TensordTypeError(
            f"unsupported operand type(s) for {symbol}: {_type_name(left)!r} and "
            f"{_type_name(right)!r}: {NO_MATH}"
        )

    return refuse


def _unary(what: str) -> Callable[..., NoReturn]:
    def refuse(self: NoMath) -> NoReturn:
        raise errors.TensordTypeError(f"bad operand type for {what}: 'tensord.Tensor': {NO_MATH}")

    return refuse


class NoMath:
    """The refusals of :class:`tensord.Tensor`'s math, with what to use instead."""

    __slots__ = ()

    if not TYPE_CHECKING:  # a type checker keeps flagging x + 1 and x.sum() itself
        __add__ = _binary("+")
        __radd__ = _binary("+", reflected=True)
        __iadd__ = _binary("+=", in_place=True)
        __sub__ = _binary("-")
        __rsub__ = _binary("-", reflected=True)
        __isub__ = _binary("-=", in_place=True)
        __mul__ = _binary("*")
        __rmul__ = _binary("*", reflected=True)
        __imul__ = _binary("*=", in_place=True)
        __truediv__ = _binary("/")
        __rtruediv__ = _binary("/", reflected=True)
        __itruediv__ = _binary("/=", in_place=True)
        __floordiv__ = _binary("//")
        __rfloordiv__ = _binary("//", reflected=True)
        __ifloordiv__ = _binary("//=", in_place=True)
        __mod__ = _binary("%")
        __rmod__ = _binary("%", reflected=True)
        __imod__ = _binary("%=", in_place=True)
        __pow__ = _binary("** or pow()")
        __rpow__ = _binary("** or pow()", reflected=True)
        __ipow__ = _binary("**=", in_place=True)
        __matmul__ = _binary("@")
        __rmatmul__ = _binary("@", reflected=True)
        __imatmul__ = _binary("@=", in_place=True)
        __and__ = _binary("&")
        __rand__ = _binary("&", reflected=True)
        __iand__ = _binary("&=", in_place=True)
        __or__ = _binary("|")
        __ror__ = _binary("|", reflected=True)
        __ior__ = _binary("|=", in_place=True)
        __xor__ = _binary("^")
        __rxor__ = _binary("^", reflected=True)
        __ixor__ = _binary("^=", in_place=True)
        __lshift__ = _binary("<<")
        __rlshift__ = _binary("<<", reflected=True)
        __ilshift__ = _binary("<<=", in_place=True)
        __rshift__ = _binary(">>")
        __rrshift__ = _binary(">>", reflected=True)
        __irshift__ = _binary(">>=", in_place=True)
        __divmod__ = _binary("divmod()")
        __rdivmod__ = _binary("divmod()", reflected=True)
        # x < y falls back on y > x: each is the other's reflection
        __lt__ = _binary("<")
        __le__ = _binary("<=")
        __gt__ = _binary(">")
        __ge__ = _binary(">=")
        __neg__ = _unary("unary -")
        __pos__ = _unary("unary +")
        __invert__ = _unary("unary ~")
        __abs__ = _unary("abs()")

        def __getattr__(self, name: str) -> Any:
            # only reached when normal lookup failed: costs nothing on the hot paths
            if name in MATH_METHODS:
                raise AttributeError(
                    f"'Tensor' object has no attribute {name!r}: {NO_MATH}", name=name, obj=self
                )
            raise AttributeError(f"'Tensor' object has no attribute {name!r}", name=name, obj=self)
