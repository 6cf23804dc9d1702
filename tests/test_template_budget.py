"""Chat templates from strangers render within a budget (runtime/templates.py): each hostile
template below ends in one `ChatTemplateError` line, within 3 s of its thread's CPU time and a small
amount of traced memory, on whatever thread renders it; the limits are the codec's to set, and
templates within them render as before (tests/test_chat_templates.py checks the real ones
against transformers)."""

from __future__ import annotations

import gc
import json
import shutil
import sys
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hostile import assert_one_clean_line, hang_guard
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tiny_models import TinySpec
from tokenizers import Tokenizer, models

from llmc.cli import main
from llmc.errors import LlmcError
from llmc.runtime.codec import TextCodec
from llmc.runtime.templates import ChatTemplateError, RenderLimits, _within

# A hostile template's rendering ends within this much of its thread's CPU time. Alone, the quarter-second
# budget's templates end at 0.26 s; late in the full suite on a 2-vCPU machine "new lists in loops" took 1.50
# and 1.51 s (not understood yet: not the process's heap, not CPU contention), so the bound is 3 s, still far
# below what the loops would run unbounded.
MAX_SECONDS = 3.0
MAX_EXTRA_BYTES = 64 * 2**20
QUICK = RenderLimits(seconds=0.25, compile_seconds=0.25)  # for the templates that run out of time: the same code, sooner
BIG = "{% set s = 'x' * 900000 %}"  # a string just within the limit of 1 MB

# name → (template, what the one line says)
HOSTILE = {
    "nested loops": ("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
                     "ran for more than 0.25 s"),
    "macro calls doubling": ("{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}"
                             "{{ f(60) }}", "ran for more than 0.25 s"),
    "new lists in loops": ("{% for i in range(100000) %}{% for j in range(100) %}{% set l = [i] * 64 %}{% endfor %}"
                           "{% endfor %}", "ran for more than 0.25 s"),
    "huge power": ("{{ 7 ** (10 ** 10) }}", "('**')"),
    "integer squared in a loop": ("{% set ns = namespace(x=3) %}{% for i in range(64) %}{% set ns.x = ns.x * ns.x %}"
                                  "{% endfor %}", "an integer of more than 65536 bits"),
    "lipsum": ("{{ lipsum(10 ** 7) }}", "(lipsum)"),
    "lipsum long": ("{{ lipsum(10 ** 5, max=10 ** 5) }}", "(lipsum)"),
    "lipsum float": ("{{ lipsum(1e7) }}", "(lipsum)"),
    "string product": ("{{ 'x' * 10 ** 10 }}", "('*')"),
    "list product": ("{{ [0] * 10 ** 9 }}", "('*')"),
    "string doubled in a loop": ("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
                                 "{% endfor %}", "('~')"),
    "list doubled in a loop": ("{% set ns = namespace(l=[1]) %}{% for i in range(64) %}{% set ns.l = ns.l + ns.l %}"
                               "{% endfor %}", "('+')"),
    "ljust": ("{{ 'x'.ljust(10 ** 9) }}", "(str.ljust)"),
    "percent width": ("{{ '%*d' % (10 ** 9, 1) }}", "('%')"),
    "percent width in the format": ("{{ ('%' ~ '9' * 9 ~ 'd') % 1 }}", "('%')"),
    "format width": ("{{ '{:>999999999}'.format(1) }}", "(str.format)"),
    "format fields": (BIG + "{{ '{0}{0}{0}'.format(s) }}", "(str.format)"),
    "range": ("{% for i in range(10 ** 9) %}{% endfor %}", "failed: OverflowError: Range too big"),
    "include": ("{% include 'base.jinja' %}", "loads another template (base.jinja): chat templates cannot use "
                                              "include, extends or import"),
    "extends": ("{% extends 'base.jinja' %}", "cannot use include, extends or import"),
    "import": ("{% import 'macros.jinja' as m %}{{ m.f() }}", "cannot use include, extends or import"),
    "from import": ("{% from 'macros.jinja' import f %}", "cannot use include, extends or import"),
    "recursive macro": ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recurses too deeply"),
    "recursive loop": ("{% set ns = namespace(l=[]) %}{% for i in range(3000) %}{% set ns.l = [ns.l] %}{% endfor %}"
                       "{% for x in ns.l recursive %}{{ loop(x) }}{% endfor %}", "recurses too deeply"),
    "replace": (BIG + "{{ s|replace('x', s) }}", "(filter 'replace')"),
    "str.replace": (BIG + "{{ s.replace('', s) }}", "(str.replace)"),
    "join": (BIG + "{{ [s, s]|join }}", "(filter 'join')"),
    "str.join": (BIG + "{{ s.join([s, s]) }}", "(str.join)"),
    "join of a generator": ("{{ range(1000)|map('center', 999999)|join }}", "(filter 'join')"),
    "literal list as text": (BIG + "{{ [s, s, s, s]|string }}", "(filter 'string')"),
    "literal list written": (BIG + "{{ [s, s, s, s] }}", "(output)"),
    "indent": ("{% set s = '\\n' * 900000 %}{{ s|indent(900000) }}", "(filter 'indent')"),
    "wordwrap": ("{% set s = 'x ' * 400000 %}{{ s|wordwrap(1, wrapstring=s) }}", "(filter 'wordwrap')"),
    "expandtabs": ("{% set s = '\\t' * 900000 %}{{ s.expandtabs(900000) }}", "(str.expandtabs)"),
    "batch filled": (BIG + "{{ [1]|batch(100000, s)|list }}", "(filter 'batch')"),
    "slices": ("{{ [1]|slice(10 ** 6)|list }}", "(filter 'slice')"),
    "center": ("{{ 'x'|center(10 ** 9) }}", "(filter 'center')"),
    "tojson indent": (BIG + "{{ [[[s]]]|tojson(indent=10) }}", "(filter 'tojson')"),
    "dict.fromkeys": (BIG + "{{ {}.fromkeys(range(1000), s)|length }}", "(dict.fromkeys)"),
    "set block": (BIG + "{% set b %}{% for i in range(100) %}{{ s }}{% endfor %}{% endset %}", "(a block)"),
    "filter block": (BIG + "{% filter upper %}{% for i in range(100) %}{{ s }}{% endfor %}{% endfilter %}",
                     "(a block)"),
    "macro output": (BIG + "{% macro f() %}{{ s }}{{ s }}{% endmacro %}{{ f() }}", "(a block)"),
    "output": (BIG + "{% for i in range(100) %}{{ s }}{% endfor %}", "more than 1000000 characters (output)"),
    "integer as text": ("{{ (10 ** 5000)|string }}", "failed: ValueError"),
    "number as an argument": ("{{ '{}|{}'.format(10 ** 12, 'x'.center(3)) }}{{ 'x'|center(10 ** 6 + 1) }}",
                              "(filter 'center')"),
    "division by zero": ("{{ 1 // 0 }}", "failed: ZeroDivisionError"),
    "syntax": ("{% for %}", "failed: Expected an expression"),
    "template too long": ("x" * 1_000_001, "longer than 1000000 characters"),
    "template slow to compile": ("{{ x }}" * 100_000, "ran for more than 0.25 s"),
    "template nested deeply": ("{{ " + "(" * 100_000 + "1" + ")" * 100_000 + " }}", "recurses too deeply"),
    "escape": ("{{ ''.__class__.__mro__ }}", "failed: access to attribute '__class__' of 'str' object is unsafe"),
}
MESSAGES = [{"role": "user", "content": "Hello"}]


def _codec(template: str, limits: RenderLimits = RenderLimits()) -> TextCodec:
    vocab = Tokenizer(models.WordLevel({"<unk>": 0, "</s>": 1}, unk_token="<unk>"))
    return TextCodec(vocab, None, 1, False, template, limits)


def _refused(codec: TextCodec) -> tuple[str, float, int]:
    """The error of rendering with `codec`, the CPU time it took (this thread's: what other threads of the
    process spend, a test's leftovers, is not the template's) and the peak traced memory."""
    tracemalloc.start()
    try:
        with hang_guard(), pytest.raises(ChatTemplateError) as info:
            start = time.thread_time()
            try:
                codec.render_chat(MESSAGES)
            finally:
                seconds = time.thread_time() - start
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return str(info.value), seconds, peak


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_template_is_one_line_fast_and_small(name: str) -> None:
    template, expected = HOSTILE[name]
    message, seconds, peak = _refused(_codec(template, QUICK if "0.25 s" in expected else RenderLimits()))
    assert_one_clean_line(message)
    assert message.startswith("the model's chat template "), message
    assert any(part in message for part in expected.split("|")), message
    assert seconds < MAX_SECONDS, f"{seconds:.2f} s: {message}"
    assert peak < MAX_EXTRA_BYTES, f"{peak / 2**20:.0f} MiB: {message}"


def test_default_budget_is_one_second() -> None:
    codec = _codec(HOSTILE["nested loops"][0])
    message, seconds, _ = _refused(codec)
    assert "ran for more than 1 s" in message
    assert seconds < MAX_SECONDS


def test_template_that_does_not_compile_fails_each_time() -> None:
    codec = _codec(HOSTILE["template slow to compile"][0], QUICK)
    first, second = _refused(codec)[0], _refused(codec)[0]
    assert first == second == "the model's chat template ran for more than 0.25 s"


def _identity(value: object) -> object:
    return value


def test_compile_deadline_survives_a_garbage_collector_callback() -> None:
    """A garbage collector's callback that runs past the deadline while the template compiles (pytest's
    plugins install such callbacks) cannot take the deadline with it: what it raises Python drops, and the
    trace function with it, so the deadline is kept in jinja2's own calls only."""
    slept: list[bool] = []

    def past_the_deadline(phase: str, info: dict) -> None:
        if not slept:
            slept.append(True)
            time.sleep(QUICK.compile_seconds + 0.05)
        _identity(phase)  # a call of Python code in the callback, after the deadline

    gc.callbacks.append(past_the_deadline)
    try:
        message, seconds, _ = _refused(_codec(HOSTILE["template slow to compile"][0], QUICK))
    finally:
        gc.callbacks.remove(past_the_deadline)
    assert slept
    assert message == "the model's chat template ran for more than 0.25 s"
    assert seconds < MAX_SECONDS, f"{seconds:.2f} s"


def test_compile_deadline_survives_a_generator_closed_after_it() -> None:
    """A jinja2 generator dropped after the deadline is closed, which resumes it as a finalizer, where
    Python drops what the trace function raises, and the trace function with it (jinja2's lexer drops a
    generator at each token: "template slow to compile" once ran 15 s, not 0.25). The compiling after it
    still ends at the deadline."""
    environment = ImmutableSandboxedEnvironment()
    tokens = environment.lexer.tokeniter("{{ x }}", None)
    next(tokens)  # started, so that dropping it resumes it
    with pytest.raises(ChatTemplateError, match="ran for more than 0 s"), _within(RenderLimits(), 0.0, trace=True):
        del tokens
        environment.parse("{{ x }}")


def test_limits_are_the_codecs() -> None:
    """The same template renders within a budget large enough, and not within a smaller one."""
    template = "{% for m in messages %}{{ m.content * 1000 }}{% endfor %}"
    assert _codec(template).render_chat(MESSAGES) == "Hello" * 1000
    with pytest.raises(ChatTemplateError, match="more than 4999 characters"):
        _codec(template, RenderLimits(chars=4999)).render_chat(MESSAGES)


def test_budget_holds_on_worker_threads_and_leaves_their_tracing_alone() -> None:
    """The server renders on worker threads, several at once: each rendering keeps its own
    deadline; the deadline of one does not end another; a thread's trace function survives."""
    hanging, fine = _codec(HOSTILE["nested loops"][0], QUICK), _codec("{{ messages[0].content }}!")

    def render(codec: TextCodec) -> str:
        tracer = lambda *args: None  # noqa: E731 — a trace function of the thread's own (a debugger's)
        sys.settrace(tracer)
        try:
            return codec.render_chat(MESSAGES)
        except LlmcError as e:
            return str(e)
        finally:
            assert sys.gettrace() is tracer
            sys.settrace(None)

    with hang_guard(), ThreadPoolExecutor(4) as pool:
        results = list(pool.map(render, [hanging, fine, hanging, fine]))
    assert results[1] == results[3] == "Hello!"
    assert "ran for more than 0.25 s" in results[0] and "ran for more than 0.25 s" in results[2]


@pytest.mark.parametrize("source", [
    "{{ messages[0].content|safe }}{% autoescape true %}{{ '<' ~ messages[0].content }}{% endautoescape %}",
    "{{ '{:>5}|{}'.format('a', messages|length) }}{{ '%5.2f|%s' % (3.14159, messages[0].role) }}",
    "{% for x in [3, 1, 2]|sort %}{{ x }}{% endfor %}{% set b %}x{{ 1 }}{% endset %}{{ b }}",
    "{{ messages|map(attribute='content')|list }}{{ 2 ** 10 }}{{ 'ab' * 2 }}{{ [1] + [2] }}{{ '%d' % 7 }}",
    "{% for m in messages recursive %}{{ loop.index }}{% endfor %}{{ range(3)|batch(2)|list }}{{ lipsum(1)|length > 0 }}",
    "{% macro f(n) %}{% if n %}{{ n }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(5) }}{{ ' x '.strip().upper() }}",
], ids=["markup", "formats", "loops and blocks", "operators", "recursive loop", "macros"])
def test_templates_within_the_budget_render_as_jinja2_renders_them(source: str) -> None:
    """What the budget checks still works as in jinja2's own sandbox."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    messages = [{"role": "user", "content": "<b>"}]
    expected = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(source)
    assert _codec(source).render_chat(messages) == expected.render(messages=messages)


@pytest.mark.parametrize("budget", [[], ["--template-seconds", "0.25"]], ids=["default", "option"])
def test_cli_run_with_a_hanging_template_is_one_line(artifact, tmp_path: Path, capsys, budget: list[str]) -> None:
    copy = tmp_path / "artifact"
    shutil.copytree(artifact(TinySpec()), copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["tokenizer"]["chat_template"] = HOSTILE["nested loops"][0]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    capsys.readouterr()
    with hang_guard():
        start = time.process_time()
        code = main(["run", str(copy), "-p", "hi", "--chat", "-n", "1", *budget])
        seconds = time.process_time() - start
    err = capsys.readouterr().err
    assert code == 2, err
    limit = budget[1] if budget else "1"
    assert err.splitlines() == [f"llmc: error: the model's chat template ran for more than {limit} s"], err
    assert seconds < MAX_SECONDS + 1  # loading the artifact besides
