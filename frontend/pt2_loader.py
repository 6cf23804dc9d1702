"""Reading a `.pt2` archive (`torch.export.save`) that came from a stranger.

torch's own loader trusts the archive: it inflates members to their declared sizes, parses
symbolic shapes with sympy's `sympify` (an `eval`, and `2**(2**(2**100))` never ends),
unpickles sample inputs (retrying without `weights_only`) and pickled payloads, and runs
guard code. `load_pt2` checks first, in work and memory proportional to the file:

- members: stored or deflated, within a budget of uncompressed bytes derived from the file
  size (a 4 MB archive cannot inflate to 4 GB), each deflated one inflated once in chunks to
  check its real size, and only the members torch.export.save writes (others torch may
  load as code: an AOTInductor package's shared library);
- the program's JSON: bounded size (32 MiB) and nesting; every symbolic expression parsed by
  `expression_problem`, a bounded checker of the forms torch writes (integers, shape
  symbols, + · // % min max, integer powers with small exponents); symbol ranges and hints
  within int64;
- payloads: plain tensors whose declared sizes fit their records; pickled payloads, legacy
  pickled weights and guard code that is not a size comparison only with `allow_pickle`.

The program is then deserialized from the checked JSON without its sample inputs (a pickle
llmc never needs), torch's warnings and log lines held back.
"""

from __future__ import annotations

import ast
import io
import json
import logging
import math
import operator
import re
import warnings
import zipfile
import zlib
from pathlib import Path

import torch
from torch.export import ExportedProgram

from llmc.errors import ModelFormatError

BUDGET_FACTOR, BUDGET_SLACK = 2, 64 * 2**20  # all members inflate to at most 2 × the file + 64 MiB
MAX_RATIO = 200  # a deflated member above 1 MiB inflates at most 200× (text manages ~20×)
MAX_JSON_BYTES = 2**25  # SmolLM2-135M's program is 4.2 MB
MAX_EXPRESSION_CHARS = 4096
MAX_EXPRESSION_NODES = 256  # syntax-tree nodes: the strides of a 4-D tensor take ~20
MAX_EXPONENT = 64
MAX_EXPRESSION_DEPTH = 32
MAX_INT = 2**63  # sizes, hints and ranges are int64

_CODE = "can run code when loaded; llmc loads it only with --allow-pickle"
# what zipfile raises for archives it cannot read (encrypted members: RuntimeError; versions and
# methods it lacks: NotImplementedError)
_ZIP_ERRORS = (zipfile.BadZipFile, zipfile.LargeZipFile, zlib.error, NotImplementedError, RuntimeError, OSError,
               EOFError, ValueError)
_ALLOWED_PYTHON_TARGETS = {
    operator.add, operator.sub, operator.mul, operator.floordiv, operator.mod, operator.neg, operator.truediv,
    operator.pow, operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge, operator.getitem,
    operator.and_, operator.or_, operator.not_, torch.sym_max, torch.sym_min, torch.sym_not, torch.sym_float,
    torch.sym_int, torch.sym_ite, torch.sym_sqrt,
}

# ------------------------------------------------------------------ symbolic expressions

# the sympy (and torch.utils._sympy) classes whose `srepr` torch writes; torch evaluates the text
_FUNCTIONS = {
    "Integer", "Float", "Rational", "Mul", "Add", "Mod", "Max", "Min", "Eq", "Ne", "Lt", "Le", "Gt", "Ge", "And",
    "Or", "Not", "FloorDiv", "ModularIndexing", "Where", "PythonMod", "CleanDiv", "CeilToInt", "FloorToInt",
    "CeilDiv", "FloatTrueDiv", "IntTrueDiv", "IsNonOverlappingAndDenseIndicator", "TruncToFloat", "TruncToInt",
    "RoundToInt", "RoundDecimal", "ToFloat", "Identity", "Symbol",
}
_POWERS = {"Pow", "PowByNatural", "FloatPow", "LShift", "RShift"}  # exponent (shift) a small integer literal
_CONSTANTS = {"oo", "zoo", "nan", "true", "false", "Infinity", "NegativeInfinity", "Zero", "One", "NegativeOne",
              "Half", "BooleanTrue", "BooleanFalse"}
_ASSUMPTIONS = {"positive", "integer", "nonnegative", "real", "finite"}
_SYMBOL = re.compile(r"[a-z]+\d+")


def _literal(node: ast.AST) -> object:
    """The value of a number literal (`5`, `-5`, `Integer(5)`, `Integer(-5)`), else None."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Integer" \
            and len(node.args) == 1:
        node = node.args[0]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant):
        value = node.operand.value
        return -value if type(value) is int else None
    return node.value if isinstance(node, ast.Constant) and type(node.value) is int else None


def expression_problem(text: str, names: bool) -> str | None:
    """What makes `text` more than a bounded shape expression of the forms torch.export writes
    (sympy's `srepr`), or None; `names`: also refuse names sympy would evaluate that torch
    does not write."""
    if len(text) > MAX_EXPRESSION_CHARS:
        return f"is {len(text)} characters long (at most {MAX_EXPRESSION_CHARS})"
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return "is not an expression (or nests too deep)"
    count, todo = 0, [(tree.body, 0, False)]
    while todo:
        node, depth, in_power = todo.pop()
        count += 1
        if count > MAX_EXPRESSION_NODES:
            return f"has more than {MAX_EXPRESSION_NODES} terms"
        if isinstance(node, ast.Constant):
            if type(node.value) is int and abs(node.value) > MAX_INT:
                return f"holds an integer beyond int64 ({len(str(node.value))} digits)"
            if isinstance(node.value, str) and len(node.value) > 64:
                return "holds a long string"
            continue
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            todo.append((node.operand, depth + 1, in_power))
            continue
        if isinstance(node, ast.Name):
            if names and node.id not in _CONSTANTS:
                return f"names '{node.id[:40]}'"
            continue
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
            return f"holds Python {type(node).__name__.lower()} syntax, not a sympy term"
        name = node.func.id
        if names and name not in _FUNCTIONS | _POWERS:
            return f"calls '{name[:40]}'"
        if name == "Symbol" and not (len(node.args) == 1 and isinstance(node.args[0], ast.Constant)
                                     and isinstance(node.args[0].value, str)
                                     and _SYMBOL.fullmatch(node.args[0].value)):
            return "has a symbol that is not a shape symbol (s0, u1, …)"
        for keyword in node.keywords:
            if keyword.arg not in _ASSUMPTIONS | {"precision"} or not isinstance(keyword.value, ast.Constant):
                return f"passes '{keyword.arg}' to {name}"
        if name in _POWERS:
            if in_power:
                return f"nests {name} in the base of a power"
            if len(node.args) != 2 or not isinstance(exponent := _literal(node.args[1]), int) \
                    or not 0 <= exponent <= MAX_EXPONENT:
                return f"raises to a power (shifts) that is not an integer from 0 to {MAX_EXPONENT}"
        if depth >= MAX_EXPRESSION_DEPTH:
            return "nests too deep"
        todo.extend((arg, depth + 1, in_power or name in _POWERS) for arg in (*node.args, *(
            k.value for k in node.keywords)))
    return None


def _values(tree: object, key: str) -> list[object]:
    """Every value of `key` in the objects of a serialized program (`expr_str`: expressions,
    `as_int`: sizes and hints)."""
    found, todo = [], [tree]
    while todo:
        item = todo.pop()
        if isinstance(item, dict):
            if key in item:
                found.append(item[key])
            todo.extend(item.values())
        elif isinstance(item, list):
            todo.extend(item)
    return found


def check_program(path: Path, program: dict, allow_pickle: bool) -> None:
    """Refuse a program whose shapes torch could not parse in bounded time."""
    for text in _values(program, "expr_str"):
        problem = "is not text" if not isinstance(text, str) else expression_problem(text, names=False)
        if problem is None and not allow_pickle and expression_problem(text, names=True):
            problem = f"{expression_problem(text, names=True)}, which {_CODE}"
        if problem is not None:
            shown = text[:80] if isinstance(text, str) else type(text).__name__
            raise ModelFormatError(path, f"symbolic shape expression '{shown}' {problem}")
    ranges = program.get("range_constraints")
    if not isinstance(ranges, dict):
        raise ModelFormatError(path, "models/model.json has no range_constraints object")
    for name, bounds in ranges.items():
        values = [bounds.get(k) for k in ("min_val", "max_val")] if isinstance(bounds, dict) else [bounds]
        if not _SYMBOL.fullmatch(name) or any(v is not None and not _int64(v) for v in values):
            raise ModelFormatError(path, f"the range of symbol '{name[:40]}' is not two int64 bounds: "
                                         f"{str(bounds)[:80]}")
    for value in _values(program, "as_int"):
        if not _int64(value):
            raise ModelFormatError(path, f"a size or hint {str(value)[:40]} is not an int64")


def _int64(value: object) -> bool:
    return type(value) is int and abs(value) <= MAX_INT


# ------------------------------------------------------------------ guard code


_GUARD_NODES = (ast.Expression, ast.Compare, ast.BoolOp, ast.BinOp, ast.UnaryOp, ast.Constant, ast.Name, ast.Load,
                ast.Subscript, ast.Attribute, ast.Call, ast.cmpop, ast.boolop, ast.operator, ast.unaryop)
_GUARD_METHODS = {"size", "stride", "dim", "storage_offset", "numel"}
_GUARD_FUNCTIONS = {"min", "max"}  # builtins torch writes into guards relating sizes


def _safe_guard(code: str) -> bool:
    """A guard (Python source that `ExportedProgram.module()` compiles and runs) that only compares
    input sizes: `L['input_ids'].size()[1] <= 128`, `min(8*L['past'][0].size()[2], …) == …`."""
    try:
        tree = ast.parse(code, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    for node in ast.walk(tree):
        if not isinstance(node, _GUARD_NODES):
            return False
        if isinstance(node, ast.Name) and node.id != "L" and node.id not in _GUARD_FUNCTIONS:
            return False
        if isinstance(node, ast.Attribute) and node.attr not in _GUARD_METHODS:
            return False
        if isinstance(node, ast.Call) and not (isinstance(node.func, ast.Attribute) or (
                isinstance(node.func, ast.Name) and node.func.id in _GUARD_FUNCTIONS)):
            return False
        if isinstance(node, ast.Constant) and type(node.value) is int and abs(node.value) > MAX_INT:
            return False
    return True


# ------------------------------------------------------------------ the archive


def _archive(path: Path, data: bytes) -> tuple[zipfile.ZipFile, str]:
    """The archive and its root folder: a torch.export archive whose members inflate within the budget."""
    try:
        if not zipfile.is_zipfile(io.BytesIO(data)):
            raise ModelFormatError(path, "is not a .pt2 archive (not a zip file, or truncated)")
        archive = zipfile.ZipFile(io.BytesIO(data))
        infos = archive.infolist()
    except _ZIP_ERRORS as e:
        raise ModelFormatError(path, f"is not a readable .pt2 archive ({e})") from e
    names = [i.filename for i in infos]
    if len(set(names)) != len(names):
        raise ModelFormatError(path, "has two archive members of one name")
    budget = BUDGET_FACTOR * len(data) + BUDGET_SLACK
    total = sum(i.file_size for i in infos)
    if total > budget:
        raise ModelFormatError(path, f"its members inflate to {total} bytes, more than {budget} for a "
                                     f"{len(data)}-byte archive (a zip bomb?)")
    for info in infos:
        _check_member(path, archive, info)
    roots = {n.split("/", 1)[0] for n in names}
    root = roots.pop() if len(roots) == 1 else ""
    required = ("archive_format", "archive_version", "models/model.json", "data/weights/model_weights_config.json",
                "data/constants/model_constants_config.json")
    missing = [m for m in required if f"{root}/{m}" not in names]
    if not root or missing:
        raise ModelFormatError(path, f"is not a torch.export archive (no {missing[0] if missing else 'root folder'})")
    if archive.read(f"{root}/archive_format") != b"pt2":  # every member's header was checked: it reads
        raise ModelFormatError(path, "is not a torch.export archive (archive_format is not pt2)")
    return archive, root


def _check_member(path: Path, archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> None:
    """A stored member's sizes agree; a deflated one inflates to its declared size, at a plausible ratio."""
    name = info.filename
    if info.compress_type == zipfile.ZIP_STORED:
        if info.compress_size != info.file_size:
            raise ModelFormatError(path, f"member '{name}' is stored with {info.compress_size} bytes but declares "
                                         f"{info.file_size}")
        try:
            archive.open(info).close()  # its local header: the name, no encryption, a version zipfile reads
        except _ZIP_ERRORS as e:
            raise ModelFormatError(path, f"member '{name}' is damaged ({e})") from e
        return
    if info.compress_type != zipfile.ZIP_DEFLATED:
        raise ModelFormatError(path, f"member '{name}' uses zip compression method {info.compress_type} (torch reads "
                                     f"stored or deflated members)")
    if info.file_size > max(2**20, MAX_RATIO * info.compress_size):
        raise ModelFormatError(path, f"member '{name}' inflates {info.compress_size} bytes to {info.file_size}, more "
                                     f"than {MAX_RATIO}× (a zip bomb?)")
    size = 0
    try:
        with archive.open(info) as member:  # zipfile stops at the declared size and checks the CRC
            while chunk := member.read(2**20):
                size += len(chunk)
    except _ZIP_ERRORS as e:
        raise ModelFormatError(path, f"member '{name}' is damaged ({e})") from e
    if size != info.file_size:
        raise ModelFormatError(path, f"member '{name}' inflates to {size} bytes, not the {info.file_size} it declares")


def _read_json(path: Path, archive: zipfile.ZipFile, name: str) -> dict:
    """A JSON member: at most MAX_JSON_BYTES, as Python objects take up to 20× their text."""
    shown = name.split("/", 1)[1]
    if (size := archive.getinfo(name).file_size) > MAX_JSON_BYTES:
        raise ModelFormatError(path, f"{shown} is {size} bytes, more than the {MAX_JSON_BYTES} llmc reads")
    try:
        value = json.loads(archive.read(name))
    except (*_ZIP_ERRORS, RecursionError) as e:
        raise ModelFormatError(path, f"{shown} is not readable JSON ({str(e)[:200]})") from e
    if not isinstance(value, dict):
        raise ModelFormatError(path, f"{shown} is not a JSON object")
    return value


# the members of an archive `torch.export.save` writes for one program (below its root folder);
# anything else (an AOTInductor package's shared library, a second program) torch may load as code
_PLAIN_MEMBERS = re.compile(r"(\.data/(serialization_id|version)|archive_format|archive_version|byteorder"
                            r"|models/model\.json|data/sample_inputs/model\.pt"
                            r"|data/weights/(model_weights_config\.json|weight_\d+)"
                            r"|data/constants/(model_constants_config\.json|tensor_\d+))")


def _payloads(path: Path, archive: zipfile.ZipFile, root: str, allow_pickle: bool) -> None:
    """Each plain weight or constant fits its record (torch would allocate what an empty one
    declares); pickled ones are refused without `allow_pickle`."""
    for kind, folder in (("weight", "weights"), ("constant", "constants")):
        config = _read_json(path, archive, f"{root}/data/{folder}/model_{folder}_config.json").get("config")
        if not isinstance(config, dict):
            raise ModelFormatError(path, f"data/{folder}/model_{folder}_config.json has no config object")
        for key, payload in config.items():
            file = str(payload.get("path_name", "")) if isinstance(payload, dict) else ""
            pickled = not isinstance(payload, dict) or payload.get("use_pickle")
            if pickled or not file.startswith(("weight_", "tensor_")):
                if allow_pickle:
                    continue
                raise ModelFormatError(path, f"has {kind} '{key[:80]}' is pickled, which {_CODE}")
            meta = payload.get("tensor_meta")
            sizes = meta.get("sizes") if isinstance(meta, dict) else None
            dims = [s.get("as_int") if isinstance(s, dict) else None for s in sizes] \
                if isinstance(sizes, list) else [None]
            if not all(type(d) is int and 0 <= d <= MAX_INT for d in dims):
                raise ModelFormatError(path, f"{kind} '{key[:80]}' has no plain sizes: {str(sizes)[:80]}")
            try:
                record = archive.getinfo(f"{root}/data/{folder}/{file}").file_size
            except KeyError:
                raise ModelFormatError(path, f"{kind} '{key[:80]}' names a missing member '{file[:80]}'") from None
            if math.prod(dims) > record:  # at least a byte an element
                raise ModelFormatError(path, f"{kind} '{key[:80]}' declares {dims} = {math.prod(dims)} elements but "
                                             f"its member '{file[:80]}' holds {record} bytes")


def _code_risks(path: Path, archive: zipfile.ZipFile, root: str, program: dict) -> list[str]:
    """What else in the archive `torch.export.load` or `.module()` would run as code."""
    risks = [f"an archive member '{name}' that torch may load as code (only the members torch.export.save "
             "writes are read)" for name in archive.namelist()
             if not name.endswith("/") and not _PLAIN_MEMBERS.fullmatch(name.removeprefix(f"{root}/"))][:1]
    if any(not isinstance(g, str) or not _safe_guard(g) for g in program.get("guards_code") or []):
        risks.append("guard code that is not a size comparison (torch compiles and runs it)")
    if any(n.endswith(".pt") and n != f"{root}/data/sample_inputs/model.pt" for n in archive.namelist()):
        risks.append("legacy pickled weights")
    return risks


def target_name(target: object) -> str:
    """An FX call target as one name: `aten.add`, `operator.mul`."""
    if isinstance(target, torch._ops.OpOverload):
        return str(target.overloadpacket)
    return f"{getattr(target, '__module__', '')}.{getattr(target, '__name__', target)}".lstrip(".")


def load_pt2(path: Path, allow_pickle: bool) -> ExportedProgram:
    """A program saved with `torch.export.save`, checked (see the module's docstring) and loaded
    without its sample inputs; without `allow_pickle`, nothing in it runs as code."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ModelFormatError(path, f"cannot be read ({e.strerror or e})") from e
    archive, root = _archive(path, data)
    program = _read_json(path, archive, f"{root}/models/model.json")
    check_program(path, program, allow_pickle)
    _payloads(path, archive, root, allow_pickle)
    if not allow_pickle and (risks := _code_risks(path, archive, root, program)):
        raise ModelFormatError(path, f"has {risks[0]}, which {_CODE}")
    ep = _deserialize(path, data, program)
    if not allow_pickle:
        for node in ep.graph.nodes:
            target = node.target
            if node.op == "call_function" and not (
                    isinstance(target, torch._ops.OpOverload) and target.namespace in ("aten", "prims")) \
                    and target not in _ALLOWED_PYTHON_TARGETS:
                raise ModelFormatError(path, f"node '{node.name}' calls {target_name(target)}, which {_CODE}")
    return ep


def _deserialize(path: Path, data: bytes, program: dict) -> ExportedProgram:
    """torch's deserializer on the checked program, its weights and constants (no sample inputs),
    its warnings and log lines held back."""
    from torch._export.serde import schema
    from torch._export.serde.serialize import ExportedProgramDeserializer, _dict_to_dataclass
    from torch.export.pt2_archive._package import PT2ArchiveReader, _load_constants, _load_state_dict

    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            reader = PT2ArchiveReader(io.BytesIO(data))
            serialized = _dict_to_dataclass(schema.ExportedProgram, program)
            return ExportedProgramDeserializer().deserialize(
                serialized, _load_state_dict(reader, "model"), _load_constants(reader, "model"), None)
    except Exception as e:  # torch's deserializer raises many types for malformed programs
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise ModelFormatError(path, f"torch cannot load the program ({first})") from e
    finally:
        logging.disable(logging.NOTSET)
