"""Chat templates rendered in jinja2's sandbox under a budget of time and size.

Templates come from model files, so from strangers. jinja2's immutable sandbox stops them
reaching outside, but not from working forever or building huge values: `x ** (10 ** 10)`,
`'x' * 10 ** 10`, `s.ljust(10 ** 9)`, a string doubled in a loop, nested loops. Here every
rendering gets a `_Budget` (`RenderLimits`: seconds, and characters for the output and for
any value it builds), and

- every operation that can build a value much larger than its operands (the `*`, `**`, `+`
  and `%` operators, `~`, calls, filters, `str.format`, captured blocks, output) first
  estimates what it would build, from its operands' sizes, and refuses what passes the limit;
- every step of a `for` loop, and each of those operations, checks the deadline (no signals
  or process-wide limits: it works on whatever thread renders, several at once); compiling a
  template, jinja2's own code, is held to a deadline of its own by a trace function on that
  thread;
- `include`, `extends` and `import` are refused, and recursion that runs out of stack ends
  the rendering.

Every way a rendering fails is a `ChatTemplateError`.
"""

from __future__ import annotations

import functools
import inspect
import json
import re
import sys
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from itertools import chain
from types import FrameType
from typing import Any

from jinja2 import BaseLoader, Template, TemplateError, meta, nodes, pass_context
from jinja2.compiler import CodeGenerator, optimizeconst
from jinja2.ext import Extension
from jinja2.runtime import Namespace, markup_join, str_join
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedEscapeFormatter, SandboxedFormatter
from jinja2.utils import _PassArg, generate_lorem_ipsum
from markupsafe import Markup

from llmc.errors import LlmcError, printable

MAX_INT_BITS = 1 << 16  # integers past this make arithmetic slow (CPython's division is quadratic)
_ON_TIME = "llmc_on_time"  # the filter `_CodeGenerator` puts on every loop
_PERCENT_CONVERSION = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?[^\d]")
_TRACED = ("jinja2.", "markupsafe", __name__)  # the modules whose calls `_Budget.tick` checks
_RESUMABLE = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR  # `_Budget.tick` skips these
_FLOAT_DIGITS = 320  # the most characters '%f' writes for a float beyond its precision


class ChatTemplateError(LlmcError):
    """A chat template that failed, or went past its budget, while rendering."""


class _Exceeded(BaseException):  # noqa: N818 — a signal, as KeyboardInterrupt: no `except Exception` in jinja2 stops it
    """A rendering past its budget, on its way out of the template's code to `_within`."""


@dataclass(frozen=True)
class RenderLimits:
    """What one rendering of a chat template may spend: `seconds` of time, and `chars`
    characters of output and of any value (string, list, ...) it builds; and the time its
    compiling may take, once per template (jinja2 compiles a real template, of 2 to 30 KB, in
    0.02 to 0.5 s; 3 times that while held to its time, and a template of `chars` characters
    in half a minute)."""

    seconds: float = 1.0
    chars: int = 1_000_000
    compile_seconds: float = 5.0


DEFAULT_LIMITS = RenderLimits()
_BUDGET: ContextVar[_Budget] = ContextVar("chat template budget")


class _Budget:
    """One rendering's limits and what it has spent: its deadline, and the sizes of values."""

    def __init__(self, limits: RenderLimits, seconds: float):
        self.limits, self.seconds = limits, seconds
        self.deadline = time.monotonic() + seconds
        # the sizes of the lists, dicts and tuples measured, with the object, so that its id
        # stays its own (the sandbox forbids changing them)
        self.sizes: dict[int, tuple[object, int]] = {}
        self.kept = 0  # the items of the values in `sizes`

    def size(self, value: object) -> int:
        """`value`'s length as text, roughly, counting what its containers hold (above the
        limit, any number above it)."""
        kind = type(value)
        if kind is str:
            return len(value)
        if kind is int:
            return value.bit_length() // 3 + 1
        if kind is list or kind is dict or kind is tuple:
            if len(value) < 16:
                return self._sum(value)
            known = self.sizes.get(id(value))
            return known[1] if known is not None else self.remember(value, self._sum(value))
        if isinstance(value, (str, bytes)):
            return len(value)
        if isinstance(value, int):
            return value.bit_length() // 3 + 1
        if isinstance(value, Namespace):
            return self._sum(value._Namespace__attrs)
        if isinstance(value, Collection) and not isinstance(value, range):
            return self._sum(value)
        return 1  # numbers, none, functions, iterators (their items are measured as they come)

    def remember(self, value: list | dict | tuple, size: int) -> int:
        """`size`, kept as `value`'s while the values kept hold no more items than the size limit
        (so that what is kept for a rendering stays small)."""
        if self.kept + len(value) <= self.limits.chars:
            self.kept += len(value)
            self.sizes[id(value)] = (value, size)
        return size

    def _sum(self, values: Collection) -> int:
        total, limit = 2, self.limits.chars
        for item in chain.from_iterable(values.items()) if isinstance(values, Mapping) else values:
            total += 2 + self.size(item)
            if total > limit:
                break
        return total

    def check(self, size: int, what: str) -> None:
        if size > self.limits.chars:
            raise _Exceeded(f"the model's chat template builds more than {self.limits.chars} characters "
                            f"({printable(what, 80)})")

    def checked(self, value: object, what: str) -> Any:
        """`value`, if it is within the limits."""
        if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
            raise _Exceeded(f"the model's chat template builds an integer of more than {MAX_INT_BITS} bits "
                            f"({what})")
        self.check(self.size(value), what)
        return value

    def arguments(self, args: tuple | list, kwargs: dict, what: str) -> None:
        """Each argument within the limits."""
        for value in (*args, *kwargs.values()):
            self.checked(value, what)

    def collect(self, items: Iterator, what: str) -> list:
        """The items of an iterator, as long as all of them together are within the limits."""
        out, total = [], 2
        for item in items:
            self.on_time()
            total += 2 + self.size(item)
            self.check(total, what)
            out.append(item)
        return out

    def on_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise _Exceeded(f"the model's chat template ran for more than {self.seconds:g} s")

    def tick(self, frame: FrameType, event: str, arg: object) -> None:
        """A trace function that ends what runs at the deadline, checked at each call of jinja2's
        own functions (compiling). Only there, and not where a generator resumes: Python drops
        what a garbage collector's callback or a finalizer raises, and the trace function with
        it, so the deadline would be gone. A generator's resumption can be its finalizer (a
        dropped generator is closed, which resumes it: `next(g for g in ...)` in jinja2's lexer
        does this at each token), and the compiling goes on through plain calls anyway."""
        if not frame.f_code.co_flags & _RESUMABLE and frame.f_globals.get("__name__", "").startswith(_TRACED):
            self.on_time()


def _percent_size(budget: _Budget, form: str, values: object) -> int:
    """An upper bound of the length of `form % values`: the format, the values, and the widths
    and precisions it asks for."""
    total = len(form) + budget.size(values)
    for width, precision in _PERCENT_CONVERSION.findall(form):
        total += _FLOAT_DIGITS + sum(int(n) for n in (width, precision) if n.isdigit())
        if total > budget.limits.chars:
            return total
    if "*" in form:  # widths given by the values
        numbers = values if isinstance(values, tuple) else (values,)
        total += sum(abs(n) for n in numbers if isinstance(n, int))
    return total


def _binop_size(budget: _Budget, operator: str, left: object, right: object) -> int:
    """An upper bound of the size of `left operator right` (0 where it is small anyway)."""
    if operator == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, (str, bytes, list, tuple)) and isinstance(n, int):
                return budget.size(seq) * max(n, 0)
        if isinstance(left, int) and isinstance(right, int):
            return (left.bit_length() + right.bit_length()) // 3
    elif operator == "**":
        if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
            return (left.bit_length() - 1) * right // 3
    elif operator == "+":
        if isinstance(left, (str, bytes, list, tuple)):
            return budget.size(left) + budget.size(right)
    elif operator == "%" and isinstance(left, str):
        return _percent_size(budget, left, right)
    return 0


def _str_method_size(budget: _Budget, text: str | bytes, name: str, args: tuple, kwargs: dict) -> int:
    """An upper bound of the length of `text.name(*args, **kwargs)` for the methods of strings
    that can build much more than they are given (0 for the others)."""
    if name == "replace" and args:
        old, new = args[0], args[1] if len(args) > 1 else kwargs.get("new", "")
        times = len(text) + 1 if not old else text.count(old) if isinstance(old, type(text)) else 0
        return len(text) + times * budget.size(new)
    if name == "expandtabs":
        width = args[0] if args else kwargs.get("tabsize", 8)
        return len(text) + text.count("\t" if isinstance(text, str) else b"\t") * (width if isinstance(width, int) else 0)
    if name == "join" and args:
        items = args[0]
        return budget.size(items) + len(text) * (len(items) if isinstance(items, Collection) else 0)
    if name == "translate":
        return len(text) * (1 + budget.size(args[0] if args else None))
    if name in ("ljust", "rjust", "center", "zfill") and args and isinstance(args[0], int):
        return max(len(text), args[0])
    return 0


# filters that can build much more than they are given: an upper bound of what they build
def _indent_size(budget, s, width=4, first=False, blank=False) -> int:
    return budget.size(s) + (str(s).count("\n") + 1) * (width if isinstance(width, int) else budget.size(width))


def _json_size(budget, value, ensure_ascii=False, indent=None, *args, **kwargs) -> int:
    width = indent if isinstance(indent, int) else budget.size(indent) if indent is not None else 0
    return budget.size(value) * (1 + width * _depth(value))


def _depth(value: object) -> int:
    """How deeply containers nest in `value` (to a bound: past it, the limit stops them anyway)."""
    level, layer = 0, [value]
    while layer and level < 1000:
        layer = [v for c in layer if isinstance(c, (list, tuple, dict)) for v in (c.values() if isinstance(c, dict)
                                                                                 else c)]
        level += 1
    return level


_FILTER_SIZES: dict[str, Callable[..., int]] = {
    "replace": lambda budget, s, old, new, count=None: _str_method_size(budget, str(s), "replace", (old, new), {}),
    "join": lambda budget, value, d="", attribute=None: (
        budget.size(value) + budget.size(d) * (len(value) if isinstance(value, Collection) else 0)),
    "indent": _indent_size,
    "wordwrap": lambda budget, s, width=79, break_long_words=True, wrapstring=None, break_on_hyphens=True: (
        budget.size(s) * (1 + budget.size(wrapstring or "\n"))),
    "batch": lambda budget, value, linecount, fill_with=None: linecount * (2 + budget.size(fill_with)),
    "slice": lambda budget, value, slices, fill_with=None: budget.size(value) + slices * (4 + budget.size(fill_with)),
    "center": lambda budget, value, width=80: max(budget.size(value), width),
    "format": lambda budget, value, *args, **kwargs: _percent_size(budget, str(value), kwargs or args),
    "tojson": _json_size,
    "pprint": lambda budget, value: budget.size(value) * (1 + _depth(value)),
    "urlize": lambda budget, value, *args, **kwargs: budget.size(value) * (60 + sum(map(budget.size, (*args, *kwargs.values())))),
}


def _bounded_filter(name: str, function: Callable) -> Callable:
    """`function` (the filter `name`) that refuses to build more than the budget allows: an
    iterator it is given is collected within the budget, its value and arguments are checked,
    so is what it would build (`_FILTER_SIZES`) and what it builds."""
    skip = 1 if _PassArg.from_obj(function) else 0  # the context jinja2 passes first
    what = f"filter '{name}'"
    estimate = _FILTER_SIZES.get(name)

    @functools.wraps(function)
    def bounded(*args, **kwargs):
        budget = _BUDGET.get()
        budget.on_time()
        args = list(args)
        if len(args) > skip and isinstance(args[skip], Iterator):
            args[skip] = budget.collect(args[skip], what)
        budget.arguments(args[skip:], kwargs, what)
        if estimate is not None:
            budget.check(estimate(budget, *args[skip:], **kwargs), what)
        return budget.checked(function(*args, **kwargs), what)

    return bounded


def lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002
    """jinja2's `lipsum`, refused where it would write more than the budget allows."""
    _BUDGET.get().check(n * max * 16, "lipsum")  # a word, its comma or stop and a space: 16 characters at most
    return generate_lorem_ipsum(n, html, min, max)


def _finalize(value: object) -> object:
    """Every value a template writes, checked before it becomes text."""
    budget = _BUDGET.get()
    budget.on_time()
    return budget.checked(value, "output")


@pass_context  # not run while compiling, as jinja2 runs filters of constants
def _on_time(context, items: Iterable) -> Iterator:
    """The items a `for` loop goes through, as long as the rendering is on time (`_CodeGenerator`)."""
    budget = _BUDGET.get()
    for item in items:
        budget.on_time()
        yield item


class _CheckedFields:
    """`str.format` whose fields are checked before each is formatted (its width), and after
    (all of them together)."""

    def vformat(self, form, args, kwargs):
        self.written = 0
        return super().vformat(form, args, kwargs)

    def format_field(self, value, spec):
        budget = _BUDGET.get()
        budget.check(budget.size(value) + sum(int(n) for n in re.findall(r"\d+", spec)), "str.format")
        text = super().format_field(value, spec)
        self.written += len(text)
        budget.check(self.written, "str.format")
        return text


class _BoundedFormatter(_CheckedFields, SandboxedFormatter):
    pass


class _BoundedEscapeFormatter(_CheckedFields, SandboxedEscapeFormatter):
    pass


class _NoLoader(BaseLoader):
    """Chat templates are one text: `include`, `extends` and `import` have nothing to load."""

    def get_source(self, environment, template):
        raise ChatTemplateError(f"the model's chat template loads another template ({printable(template, 80)}): "
                                "chat templates cannot use include, extends or import")


class _CodeGenerator(CodeGenerator):
    """jinja2's code generator, with `~` joined by the environment (which checks the size), and
    every `for` loop's items taken through `_on_time`, so that loops end at the deadline."""

    def visit_Template(self, node: nodes.Template, frame=None) -> None:
        for loop in node.find_all(nodes.For):
            loop.iter = nodes.Filter(loop.iter, _ON_TIME, [], [], None, None, lineno=loop.lineno)
        super().visit_Template(node, frame)

    @optimizeconst
    def visit_Concat(self, node: nodes.Concat, frame) -> None:
        if frame.eval_ctx.volatile:
            self.write("(environment.markup_join if context.eval_ctx.volatile else environment.str_join)((")
        else:
            self.write(f"environment.{'markup_join' if frame.eval_ctx.autoescape else 'str_join'}((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox, where each operation that could build a large value checks
    it against the rendering's budget first, with what transformers' chat templates expect:
    blocks trimmed, loop controls (`break`, `continue`), `{% generation %}`, transformers'
    `tojson`, and the globals `raise_exception` and `strftime_now`."""

    code_generator_class = _CodeGenerator
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self):
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", _Generation],
                         loader=_NoLoader(), finalize=_finalize)
        self.filters["tojson"] = _tojson
        self.filters = {name: _bounded_filter(name, f) for name, f in self.filters.items()} | {_ON_TIME: _on_time}
        self.globals.update(raise_exception=_raise_exception, lipsum=lipsum,
                            strftime_now=lambda fmt: datetime.now().strftime(fmt))

    def call_binop(self, context, operator, left, right):
        budget = _BUDGET.get()
        budget.on_time()
        if operator == "+" and type(left) is str and type(right) is str:  # most templates' most common operation
            budget.check(len(left) + len(right), "'+'")
            return left + right
        estimate = _binop_size(budget, operator, left, right)
        budget.check(estimate, f"'{operator}'")
        result = super().call_binop(context, operator, left, right)
        if estimate and type(result) in (list, tuple):  # a new sequence: its estimate its size, not measured again
            budget.remember(result, estimate)
            return result
        return budget.checked(result, f"'{operator}'")

    def call(self, context, obj, /, *args, **kwargs):
        budget = _BUDGET.get()
        budget.on_time()
        what = printable(getattr(obj, "__qualname__", None) or type(obj).__name__, 60)
        budget.arguments(args, kwargs, what)
        owner = getattr(obj, "__self__", None)
        if isinstance(owner, (str, bytes)):
            if getattr(obj, "__name__", None) == "join" and args and isinstance(args[0], Iterator):
                args = (budget.collect(args[0], what), *args[1:])
            budget.check(_str_method_size(budget, owner, obj.__name__, args, kwargs), what)
        return budget.checked(super().call(context, obj, *args, **kwargs), what)

    def wrap_str_format(self, value):
        """`str.format` and `format_map`, sandboxed as jinja2 does, with each field checked."""
        if super().wrap_str_format(value) is None:
            return None
        form = value.__self__

        def bounded(*args, **kwargs):
            if value.__name__ == "format_map":
                if kwargs or len(args) != 1:
                    raise TypeError("format_map() takes exactly one argument")
                args, kwargs = (), args[0]
            formatter = (_BoundedEscapeFormatter(self, escape=form.escape) if isinstance(form, Markup)
                         else _BoundedFormatter(self))
            return type(form)(formatter.vformat(form, args, kwargs))

        return functools.update_wrapper(bounded, value)

    def concat(self, parts: Iterable[str]) -> str:
        """A captured block's text (a macro's, a `set` block's, a `filter` block's, a block's)."""
        budget, out, written = _BUDGET.get(), [], 0
        budget.on_time()
        for part in parts:
            written += len(part)
            budget.check(written, "a block")
            out.append(part)
        return "".join(out)

    def str_join(self, parts: tuple) -> str:
        """`a ~ b ~ ...` (`_CodeGenerator`)."""
        _check_join(parts)
        return str_join(parts)

    def markup_join(self, parts: tuple) -> str:
        """`a ~ b ~ ...` where output is escaped."""
        _check_join(parts)
        return markup_join(parts)


def _check_join(parts: tuple) -> None:
    budget = _BUDGET.get()
    budget.on_time()
    budget.check(sum(map(budget.size, parts)), "'~'")


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """transformers' `tojson`: plain `json.dumps`, non-ASCII kept (jinja2's own escapes HTML
    characters and sorts keys)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _Generation(Extension):
    """`{% generation %}…{% endgeneration %}`, which transformers' templates use to mark the
    assistant's text for training masks: renders its body, in a scope of its own."""

    tags = {"generation"}

    def parse(self, parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


@contextmanager
def _within(limits: RenderLimits, seconds: float, trace: bool = False) -> Iterator[_Budget]:
    """A budget for the code run inside, on this thread, and what goes wrong a
    `ChatTemplateError` (the template is a stranger's program: whatever it raises is its
    failure). With `trace`, a trace function keeps the deadline (the thread's own one put back
    after): for code other than the template's, whose operations check it themselves (tracing
    would make them several times slower)."""
    budget = _Budget(limits, seconds)
    token = _BUDGET.set(budget)
    previous = sys.gettrace()
    if trace:
        sys.settrace(budget.tick)
    try:
        yield budget
    except _Exceeded as e:
        raise ChatTemplateError(str(e)) from None
    except ChatTemplateError:
        raise
    except TemplateError as e:
        raise ChatTemplateError(f"the model's chat template failed: {printable(e)}") from e
    except RecursionError as e:
        raise ChatTemplateError("the model's chat template failed: it recurses too deeply") from e
    except MemoryError as e:
        raise ChatTemplateError("the model's chat template failed: out of memory") from e
    except Exception as e:
        raise ChatTemplateError(f"the model's chat template failed: {type(e).__name__}: {printable(e)}") from e
    finally:
        if trace:
            sys.settrace(previous)
        _BUDGET.reset(token)


def compile_template(source: str, limits: RenderLimits = DEFAULT_LIMITS) -> Template:
    """A chat template's text compiled for `render`, within `limits` (its length counted as
    output, its time `compile_seconds`)."""
    if len(source) > limits.chars:
        raise ChatTemplateError(f"the model's chat template is longer than {limits.chars} characters")
    with _within(limits, limits.compile_seconds, trace=True):
        return _BoundedEnvironment().from_string(source)


def render(template: Template, variables: dict[str, Any], limits: RenderLimits = DEFAULT_LIMITS) -> str:
    """`template` rendered with `variables` within `limits`; a `ChatTemplateError` otherwise."""
    with _within(limits, limits.seconds) as budget:
        parts, written = [], 0
        for part in template.generate(**variables):
            written += len(part)
            budget.check(written, "output")
            parts.append(part)
        return "".join(parts)


@functools.lru_cache(maxsize=8)
def template_variables(source: str, limits: RenderLimits = DEFAULT_LIMITS) -> frozenset[str]:
    """The variables a chat template reads from its caller (parsed within `limits`, once per text): e.g.
    whether it renders `tools` itself, `"tools" in template_variables(codec.chat_template)`."""
    if len(source) > limits.chars:
        raise ChatTemplateError(f"the model's chat template is longer than {limits.chars} characters")
    with _within(limits, limits.compile_seconds, trace=True):
        return frozenset(meta.find_undeclared_variables(_BoundedEnvironment().parse(source)))
