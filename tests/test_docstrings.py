"""Module docstrings say what the module is for in a few lines; how it works and why lives in docs/INTERNALS.md,
one section per module, which each such docstring names."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("moe_jax", "host_kernels")
MOST_WORDS = 100  # about seven lines of this project's 120-column text
POINTER = re.compile(r"docs/INTERNALS\.md, ([\w/.]+\.py)\.")


def module_docstrings():
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield path.relative_to(ROOT).as_posix(), ast.get_docstring(ast.parse(path.read_text())) or ""


def test_module_docstrings_are_a_few_lines():
    long = {path: len(doc.split()) for path, doc in module_docstrings() if len(doc.split()) > MOST_WORDS}
    assert not long, f"module docstrings over {MOST_WORDS} words (move how and why to docs/INTERNALS.md): {long}"


def test_every_pointer_names_its_own_section_and_every_section_a_module():
    sections = set(re.findall(r"^## (\S+\.py)$", (ROOT / "docs/INTERNALS.md").read_text(), re.M))
    pointers = {}
    for path, doc in module_docstrings():
        named = POINTER.findall(doc)
        if named:
            pointers[path] = named
    assert pointers, "no module docstring points to docs/INTERNALS.md"
    for path, named in pointers.items():
        assert named == [path], f"{path}'s docstring points to the section of {named}"
    assert sections == set(pointers), (
        f"sections without a module pointing to them: {sorted(sections - set(pointers))}; "
        f"pointers without a section: {sorted(set(pointers) - sections)}"
    )
