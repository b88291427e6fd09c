"""The tree stays readable: modules and functions of a size one can hold in mind.

A module over MAX_MODULE_LINES holds more than one concept; a function over MAX_FUNCTION_LINES
must say why it is kept whole, in a docstring sentence starting with KEPT_WHOLE (a numba kernel
whose loop nest must stay one compiled unit, say).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TREES = ("colibri", "tests", "bench", "tools", "fuzz")
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60
KEPT_WHOLE = "Kept whole:"


def _modules() -> list[Path]:
    out = []
    for tree in TREES:
        out += [p for p in (ROOT / tree).rglob("*.py") if "data" not in p.relative_to(ROOT).parts]
    return sorted(out)


def test_the_scan_finds_the_tree():
    names = {p.relative_to(ROOT).as_posix() for p in _modules()}
    assert "colibri/cli.py" in names and "tests/test_structure.py" in names


@pytest.mark.parametrize("path", _modules(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_module_size(path: Path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, f"{lines} lines: split it by concept"


def _long_functions(source: str) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = node.end_lineno - node.lineno + 1
            doc = ast.get_docstring(node) or ""
            if length > MAX_FUNCTION_LINES and KEPT_WHOLE not in doc:
                out.append(f"{node.name} ({length} lines)")
    return out


@pytest.mark.parametrize("path", _modules(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_function_size(path: Path):
    assert _long_functions(path.read_text()) == []


def test_the_function_check_can_fail():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    assert _long_functions(f"def f():\n{body}\n") == ["f (61 lines)"]
    kept = f'def f():\n    """{KEPT_WHOLE} a reason."""\n{body}\n'
    assert _long_functions(kept) == []


# ------------------------------------------------------------------------------------ the web console
#
# The console (colibri/api/web) is ES modules served as they are: no build step, so what is in
# the tree is what the browser runs, and the same measure holds for it in JavaScript's terms.
# A page module is one view or one protocol, read without types or an IDE's help: half the Python
# limit (the largest, the expert map, is about 220 lines). A function a reader sees whole on one
# screen: the page has no kernel that must stay one compiled unit, so there is no "Kept whole".

WEB = ROOT / "colibri" / "api" / "web"
WEB_PAGE = "index.html"
MAX_WEB_MODULE_LINES = 250
MAX_WEB_FUNCTION_LINES = 40
# An XML namespace is a name, not a location: nothing is fetched from it.
XML_NAMESPACES = {"http://www.w3.org/2000/svg"}


def _web_modules() -> list[Path]:
    return sorted(WEB.glob("*.js"))


def _web_files() -> list[Path]:
    return sorted(p for p in WEB.iterdir() if p.is_file())


# A regular expression literal may follow these (after anything else a slash divides).
_REGEX_AFTER = set("(,=:[!&|?{};+-*%<>~^}") | {
    "", "return", "typeof", "case", "do", "else", "in", "of", "new", "delete", "void", "throw",
    "yield", "await", "instanceof",
}


def _quoted_end(src: str, i: int) -> int:
    """The index just past the string literal that opens at ``src[i]``."""
    j = i + 1
    while j < len(src) and src[j] != src[i] and src[j] != "\n":
        j += 2 if src[j] == "\\" else 1
    return j + 1


def _regex_end(src: str, i: int) -> int | None:
    """The index just past the regular expression literal (and its flags) at ``src[i]``, or None
    when the line ends first (then the slash divides)."""
    j, in_class = i + 1, False
    while j < len(src) and src[j] != "\n":
        c = src[j]
        if c == "\\":
            j += 2
            continue
        if c == "/" and not in_class:
            j += 1
            while j < len(src) and (src[j].isalnum() or src[j] == "_"):
                j += 1
            return j
        if c in "[]":
            in_class = c == "["  # a slash inside [...] does not end it
        j += 1
    return None


def _comment_end(src: str, i: int) -> int:
    """The index just past the comment that opens at ``src[i]`` (a line's end stays code)."""
    if src.startswith("//", i):
        end = src.find("\n", i)
        return len(src) if end < 0 else end
    end = src.find("*/", i + 2)
    return len(src) if end < 0 else end + 2


def _template_text_end(src: str, i: int) -> tuple[int, bool]:
    """From ``src[i]`` inside a template literal's text: the index past its end (a backtick) or past
    the next ``${``, and whether an expression opened there."""
    j = i
    while j < len(src):
        if src[j] == "\\":
            j += 2
        elif src[j] == "`":
            return j + 1, False
        elif src.startswith("${", j):
            return j + 2, True
        else:
            j += 1
    return j, False


def _js_code(src: str) -> str:
    """``src`` with its comments, the text of its strings and template literals, and its regular
    expressions blanked (newlines kept): what is left is code, whose braces pair up."""
    out = list(src)

    def blank(a: int, b: int) -> None:
        for k in range(a, min(b, len(src))):
            if out[k] != "\n":
                out[k] = " "

    i, depth, last = 0, 0, ""
    open_templates: list[int] = []  # the brace depth at each open ``${``
    while i < len(src):
        c = src[i]
        if src.startswith(("//", "/*"), i):
            end = _comment_end(src, i)
            blank(i, end)
            i = end
            continue
        if c == "`" or (c == "}" and open_templates and open_templates[-1] == depth):
            if c == "}":
                open_templates.pop()
            end, opened = _template_text_end(src, i + 1)
            blank(i, end)
            if opened:
                open_templates.append(depth)
            i, last = end, "`"
            continue
        if c in "'\"":
            end = _quoted_end(src, i)
            blank(i, end)
            i, last = end, "'"
            continue
        if c == "/" and last in _REGEX_AFTER:
            end = _regex_end(src, i)
            if end is not None:
                blank(i, end)
                i, last = end, "/re/"
                continue
        word = re.match(r"[A-Za-z_$][\w$]*|\d[\w.]*", src[i:])
        if word:
            i, last = i + word.end(), word.group()
            continue
        depth += {"{": 1, "}": -1}.get(c, 0)
        if not c.isspace():
            last = c
        i += 1
    return "".join(out)


# Words that put a parenthesis before a block that is not a function's body.
_NOT_A_FUNCTION = {"if", "for", "while", "switch", "catch", "with", "return", "typeof", "await", "else", "do"}


def _open_paren(code: str, close: int) -> int:
    """The index of the ``(`` that the ``)`` at ``close`` closes."""
    depth = 0
    for k in range(close, -1, -1):
        depth += {")": 1, "(": -1}.get(code[k], 0)
        if depth == 0:
            return k
    return 0


def _function_head(code: str, brace: int) -> tuple[str, int] | None:
    """The function whose body opens with the ``{`` at ``brace``: its name and where its head
    starts; None for any other block."""
    before = code[:brace].rstrip()
    if before.endswith("=>"):
        m = re.search(r"(?:([\w$]+)\s*[=:]\s*)?(?:async\s*)?(?:\([^()]*\)|[\w$]+)\s*$", before[:-2])
        return ((m.group(1) or "(arrow)"), m.start()) if m else ("(arrow)", len(before))
    if not before.endswith(")"):
        return None
    head = code[: _open_paren(code, len(before) - 1)]
    m = re.search(r"(function\s*\*?\s*)?([\w$]*)\s*$", head)
    if m.group(1):
        return (m.group(2) or "(anonymous)"), m.start()
    if m.group(2) and m.group(2) not in _NOT_A_FUNCTION:
        return m.group(2), m.start()  # a method: name(params) {
    return None


def _js_functions(src: str) -> list[tuple[str, int]]:
    """Every function of a JavaScript module (declarations, methods, arrows with a body), as
    (name, lines from its head to its closing brace)."""
    code = _js_code(src)
    line_of = [0] * (len(code) + 1)
    for k, c in enumerate(code):
        line_of[k + 1] = line_of[k] + (c == "\n")
    stack: list[tuple[str, int] | None] = []
    out = []
    for k, c in enumerate(code):
        if c == "{":
            stack.append(_function_head(code, k))
        elif c == "}" and stack:
            head = stack.pop()
            if head is not None:
                out.append((head[0], line_of[k] - line_of[head[1]] + 1))
    return out


def _long_js_functions(src: str) -> list[str]:
    return [f"{name} ({n} lines)" for name, n in _js_functions(src) if n > MAX_WEB_FUNCTION_LINES]


_IMPORT = re.compile(
    r"""(?:^\s*(?:import|export)\b[^'"`;]*?\bfrom\s*|\bimport\s*\(\s*|^\s*import\s*)(['"])(.+?)\1""",
    re.MULTILINE,
)
_SCRIPT = re.compile(r"<script\b([^>]*)>", re.IGNORECASE)


def _imports(src: str) -> list[str]:
    """The modules a JavaScript module imports (static, re-exported or dynamic), as written."""
    return [m.group(2) for m in _IMPORT.finditer(_js_code_keeping_strings(src))]


def _js_code_keeping_strings(src: str) -> str:
    """``src`` without its comments (an import named in a comment is no import)."""
    return re.sub(r"/\*.*?\*/|^\s*//[^\n]*", "", src, flags=re.MULTILINE | re.DOTALL)


def _page_scripts(html: str) -> list[tuple[str, bool]]:
    """The scripts an HTML page loads: (src, whether it is a module)."""
    out = []
    for m in _SCRIPT.finditer(html):
        src = re.search(r"""\bsrc\s*=\s*["']([^"']+)["']""", m.group(1))
        if src:
            out.append((src.group(1), re.search(r"""\btype\s*=\s*["']?module\b""", m.group(1)) is not None))
    return out


def _unreached(modules: dict[str, str], entries: list[str]) -> tuple[set[str], list[str]]:
    """Which of ``modules`` (file name -> source, one folder) no chain of imports from ``entries``
    reaches, and the imports that name no module there."""
    seen, todo, broken = set(), list(entries), []
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        if name not in modules:
            broken.append(name)
            continue
        seen.add(name)
        for spec in _imports(modules[name]):
            if not spec.startswith("./") or "/" in spec[2:]:
                broken.append(f"{name}: {spec} (a module beside it: ./name.js)")
            else:
                todo.append(spec[2:])
    return set(modules) - seen, broken


_URL = re.compile(r"""(?:\b[a-z][a-z0-9+.-]*:|(?<=["'(]))//[\w.-]+[^\s"'`)<>]*""", re.IGNORECASE)


def _foreign_urls(text: str) -> list[str]:
    """What in a web file names another host (an absolute or a scheme-relative URL)."""
    return [u for u in _URL.findall(text) if u not in XML_NAMESPACES]


def test_the_web_scan_finds_the_console():
    names = {p.name for p in _web_modules()}
    assert {"console.js", "sse.js", "chat.js"} <= names
    found = {name for p in _web_modules() for name, _ in _js_functions(p.read_text())}
    assert {"renderMarkdown", "splitEvents", "send", "exchange", "drawMap", "append"} <= found


@pytest.mark.parametrize("path", _web_modules(), ids=lambda p: p.name)
def test_web_module_size(path: Path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_WEB_MODULE_LINES, f"{lines} lines: split it by concept"


@pytest.mark.parametrize("path", _web_modules(), ids=lambda p: p.name)
def test_web_function_size(path: Path):
    assert _long_js_functions(path.read_text()) == []


def test_every_web_module_is_loaded_by_the_page():
    """index.html loads its entry as a module; every module is imported by it or by another
    module, and every import names a module beside it (a flat folder: what the package ships)."""
    scripts = _page_scripts((WEB / WEB_PAGE).read_text())
    assert scripts and all(module for _, module in scripts), scripts
    entries = [src.lstrip("/") for src, _ in scripts]
    dead, broken = _unreached({p.name: p.read_text() for p in _web_modules()}, entries)
    assert broken == [] and dead == set(), f"not loaded: {sorted(dead)}; broken imports: {broken}"


@pytest.mark.parametrize("path", _web_files(), ids=lambda p: p.name)
def test_web_files_name_no_other_host(path: Path):
    assert _foreign_urls(path.read_text()) == []


def test_web_files_are_served_with_their_types():
    """A module is served as JavaScript (the browser refuses to run it otherwise), whatever the
    machine's MIME table says; each file is found in the site and nothing beside it is."""
    from colibri.api.static import StaticSite, content_type

    site = StaticSite(WEB)
    types = {".js": "text/javascript", ".css": "text/css", ".html": "text/html"}
    for path in _web_files():
        assert content_type(path.name) == types[path.suffix], path.name
        assert site.resolve(path.name) == path.resolve()
    assert site.resolve("../static.py") is None and site.resolve("%2e%2e/static.py") is None


def test_the_web_checks_can_fail(monkeypatch):
    body = "\n".join(f"  const x{i} = '}}' + `${{ {{a: {i}}} }}` + /[}}{{]/.source; // }}" for i in range(40))
    assert _long_js_functions(f"export function f() {{\n{body}\n}}\n") == ["f (42 lines)"]
    short = "\n".join(f"  x{i}();" for i in range(38))
    assert _long_js_functions(f"const g = async (a) => {{\n{short}\n}};\n") == []
    assert _long_js_functions(f"class C {{\n  m(a) {{\n{body}\n  }}\n}}\n") == ["m (42 lines)"]
    assert _long_js_functions(f"if (a) {{\n{body}\n}}\n") == []  # a block, not a function
    main = 'import {\n  a,\n} from "./a.js";\n// import "./b.js"\n'
    modules = {"main.js": main, "a.js": "", "b.js": "", "c.js": ""}
    assert _unreached(modules, ["main.js"]) == ({"b.js", "c.js"}, [])
    assert _unreached({"main.js": 'import "./sub/x.js";'}, ["main.js"])[1] != []
    assert _foreign_urls('import x from "https://cdn.example/x.js";') == ["https://cdn.example/x.js"]
    assert _foreign_urls('<script src="//cdn.example/x.js">') == ["//cdn.example/x.js"]
    assert _foreign_urls('createElementNS("http://www.w3.org/2000/svg", "g")') == []
    import mimetypes

    from colibri.api.static import content_type

    monkeypatch.setattr(mimetypes, "guess_type", lambda *a, **k: ("text/plain", None))
    assert content_type("chat.js") == "text/javascript"
