"""JSON values as types, for any layer: what `json.loads` returns and `json.dumps` takes.

`JSONValue` is exact (a recursive union) and so invariant in its containers: a `dict[str, int]`
is not a `JSONObject`. Build JSON with these types where it is made; where a function only reads
a value of unknown shape, take `object` (or `Mapping[str, object]`) and narrow with isinstance.
"""

from __future__ import annotations

JSONScalar = str | int | float | bool | None
JSONValue = JSONScalar | list["JSONValue"] | dict[str, "JSONValue"]
JSONObject = dict[str, JSONValue]
JSONList = list[JSONValue]
