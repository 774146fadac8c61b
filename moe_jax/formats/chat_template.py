"""Chat templates rendered as transformers renders them, in jinja2's immutable sandbox.

How it works and why: docs/INTERNALS.md, moe_jax/formats/chat_template.py.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from moe_jax.errors import InputError


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for a mask; here it renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` for templates without the class itself (no `dict.__class__...` from inside)."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja2's namespace, refusing underscore names (no way to store or reach dunder attributes)."""

    def __init__(*args, **kwargs):  # jinja2's own signature trick, so that namespace(self=...) still works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template may not store {name!r} on a namespace")


@functools.lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(source)


def render_template(source: str, where: str = "", **variables) -> str:
    """`source` rendered with `variables` in the sandbox. A template that does not parse, raises, or reaches for
    what the sandbox refuses is an InputError (prefixed with `where`), never code run on this machine."""
    if not isinstance(source, str):
        raise InputError(f"{where}the chat template must be a string, got {type(source).__name__}")
    try:
        return _compile(source).render(**variables)
    except jinja2.exceptions.SecurityError as e:
        raise InputError(f"{where}the checkpoint's chat template tried something unsafe, refused: {e}") from None
    except jinja2.exceptions.TemplateError as e:
        raise InputError(f"{where}the checkpoint's chat template failed: {e}") from None
    except (OverflowError, MemoryError, RecursionError) as e:  # the sandbox's limits (a range over 100000 items)
        raise InputError(f"{where}the checkpoint's chat template hit a limit: {type(e).__name__}: {e}") from None
    except (TypeError, ValueError, AttributeError, KeyError, IndexError) as e:  # a value of a shape it cannot take
        raise InputError(f"{where}the chat template cannot render these messages: {type(e).__name__}: {e}") from None
