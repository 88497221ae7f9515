"""Documented limits on every request, checked before anything touches the pool (SECURITY.md).

One pure walk over a decoded request message: list lengths, string lengths and
the integers of shapes, strides and offsets.  The layout engine and the pool do
the semantic checks (views inside their Storage, sizes against capacity); these
bounds make sure the numbers they compute with stay far from int64 overflow.
"""

from __future__ import annotations

from google.protobuf import descriptor as d
from google.protobuf.message import Message
from tensord.errors import InvalidArgumentError

# Dimensions of a tensor (torch's own limit is 64 too: c10's MAX_DIMS-sized containers).
MAX_DIMS = 64
# Fields that are a list of per-dimension numbers.
DIM_FIELDS = frozenset(
    {"shape", "stride", "size", "sizes", "dims", "repeats", "source", "destination", "values"}
)
# Any other repeated field (handles to release or cat, index items, split sections).
MAX_LIST_LEN = 65536
# Names, handles, tokens, dtypes, devices, client names.
MAX_STRING_BYTES = 4096
# Every integer in a shape, stride or offset: |n| <= 2**48, so a product or sum of up
# to 64 of them, times an itemsize, is checked by the pool long before int64 overflows.
MAX_EXTENT = 1 << 48
# Elements of one tensor (2**48 is also far beyond any pool's capacity).
MAX_NUMEL = 1 << 48
# Index/shape-like integer fields bounded by MAX_EXTENT.
EXTENT_FIELDS = DIM_FIELDS | frozenset({"storage_offset", "start", "length", "index", "offset"})


def check_request(message: Message, depth: int = 0) -> None:
    """Refuse a request whose lists, strings or extents exceed the limits above."""
    for field, value in message.ListFields():
        if field.is_repeated:
            limit = MAX_DIMS if field.name in DIM_FIELDS else MAX_LIST_LEN
            if len(value) > limit:
                raise InvalidArgumentError(
                    f"{message.DESCRIPTOR.name}.{field.name} has {len(value)} items; "
                    f"the limit is {limit}"
                )
            items = list(value)
        else:
            items = [value]
        for item in items:
            _check_value(message, field, item, depth)
    if "shape" in message.DESCRIPTOR.fields_by_name:
        numel = 1
        for n in message.shape:
            numel *= max(int(n), 0)
        if numel > MAX_NUMEL:
            raise InvalidArgumentError(
                f"a tensor of {numel} elements exceeds the limit {MAX_NUMEL}"
            )


def _check_value(message: Message, field: d.FieldDescriptor, item: object, depth: int) -> None:
    if isinstance(item, Message):
        if depth < 8:
            check_request(item, depth + 1)
    elif isinstance(item, str):
        if len(item.encode()) > MAX_STRING_BYTES:
            raise InvalidArgumentError(
                f"{message.DESCRIPTOR.name}.{field.name} is longer than {MAX_STRING_BYTES} bytes"
            )
    elif (
        isinstance(item, int)
        and not isinstance(item, bool)
        and field.name in EXTENT_FIELDS
        and abs(item) > MAX_EXTENT
    ):
        raise InvalidArgumentError(
            f"{message.DESCRIPTOR.name}.{field.name} = {item} is outside +-{MAX_EXTENT}"
        )
