"""Request bodies against sglang 0.5.23's `io_struct.py` structs (`InitWeightsUpdateGroupReqInput`, …),
read as source from the wheel `sglang_schema.py` caches: importing it needs all of sglang.

A body conforms when it names only the struct's fields (with `BaseReq`'s), gives every field that has no
default, and each value has the field's annotated type.
"""

from __future__ import annotations

import ast
import zipfile
from dataclasses import dataclass
from typing import Any

from tests.support.sglang_schema import default_cache_dir

IO_STRUCT = "sglang/srt/managers/io_struct.py"


@dataclass(frozen=True)
class StructField:
    annotation: str
    required: bool


def io_struct_fields(class_name: str) -> dict[str, StructField]:
    """Field name → annotation source and whether it is required, of an io_struct.py class (with
    BaseReq's), from the cached wheel; FileNotFoundError when the wheel is not cached."""
    wheels = sorted(default_cache_dir().glob("sglang-*.whl"))
    if not wheels:
        raise FileNotFoundError(f"no sglang wheel in {default_cache_dir()}")
    with zipfile.ZipFile(wheels[0]) as wheel:
        tree = ast.parse(wheel.read(IO_STRUCT))
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    fields: dict[str, StructField] = {}
    for name in ("BaseReq", class_name):
        for statement in classes[name].body:
            if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
                required = statement.value is None
                fields[statement.target.id] = StructField(ast.unparse(statement.annotation), required)
    return fields


def conforms(value: Any, annotation: str) -> bool:
    """Whether `value` (decoded JSON) has the type `annotation` (io_struct's typing source) names."""
    node = ast.parse(annotation, mode="eval").body
    return _matches(value, node)


def _matches(value: Any, node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        kinds: dict[str, Any] = {"str": str, "int": int, "float": (int, float), "bool": bool}
        if node.id == "int" and isinstance(value, bool):
            return False
        return isinstance(value, kinds[node.id])
    if isinstance(node, ast.Constant) and node.value is None:
        return value is None
    assert isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name), ast.unparse(node)
    outer, inner = node.value.id, node.slice
    if outer == "Optional":
        return value is None or _matches(value, inner)
    if outer == "List":
        return isinstance(value, list) and all(_matches(item, inner) for item in value)
    if outer == "Literal":
        return value in ast.literal_eval(inner)
    if outer == "Union":
        assert isinstance(inner, ast.Tuple)
        return any(_matches(value, option) for option in inner.elts)
    raise AssertionError(f"unhandled annotation {ast.unparse(node)}")


def check_body(class_name: str, body: dict[str, Any]) -> None:
    """Assert that `body` is a valid `class_name` of io_struct.py."""
    fields = io_struct_fields(class_name)
    unknown = set(body) - set(fields)
    assert not unknown, f"{class_name} has no field {sorted(unknown)}"
    missing = [name for name, spec in fields.items() if spec.required and name not in body]
    assert not missing, f"{class_name} needs {missing}"
    for name, value in body.items():
        assert conforms(value, fields[name].annotation), (class_name, name, value, fields[name].annotation)
