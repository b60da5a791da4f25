"""The shape of kvcal's product code: no function over MAX_LINES lines.

Python (python/kvcal, generated stubs aside) is measured by the AST
(first line of the `def` to its last line). C++ and CUDA (kernels/,
service/, client/, util/, proto/) by braces: from the line of a function
body's opening brace to the line of its closing one, after comments,
string literals and preprocessor lines are blanked out; a brace whose
statement head has no parenthesis, or names a namespace, class, struct,
enum, union or extern block, opens a scope, not a function, and braces
inside a function body are its own blocks. Tests, benchmarks and tools
are not product code. A check of the checker runs it on small samples.
"""
import ast
import os
import re

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
MAX_LINES = 80
CPP_DIRS = ("kernels", "service", "client", "util", "proto")
CPP_SUFFIXES = (".cc", ".h", ".cu", ".cuh")
_SCOPE = re.compile(r"^\s*(template\s*<.*>\s*)?(namespace|class|struct|enum|union|extern)\b")


def _blank(text: str) -> str:
    """`text` with comments, string and character literals and preprocessor
    directives replaced by nothing (newlines kept, so lines still count)."""
    keep_lines = lambda m: "\n" * m.group(0).count("\n")  # noqa: E731
    text = re.sub(r'R"([^(]*)\((?:.|\n)*?\)\1"', keep_lines, text)
    text = re.sub(r"/\*(?:.|\n)*?\*/", keep_lines, text)
    text = re.sub(r"//[^\n]*", "", text)
    text = re.sub(r'"(?:\\.|[^"\\\n])*"', '""', text)
    text = re.sub(r"'(?:\\.|[^'\\\n])*'", "''", text)
    return re.sub(r"(?m)^[ \t]*#(?:[^\n]*\\\n)*[^\n]*", keep_lines, text)


def cpp_functions(text: str):
    """[(lines, first line, head)] of every function body in C++ `text`."""
    stack, out, head, line = [], [], "", 1
    for ch in _blank(text):
        if ch == "\n":
            line += 1
            head += " "
        elif ch == "{":
            h = " ".join(head.split())
            if any(kind == "fn" for kind, _, _ in stack):
                kind = "block"
            elif _SCOPE.match(h) or "(" not in h or h.endswith("="):
                kind = "scope"
            else:
                kind = "fn"
            stack.append((kind, line, h))
            head = ""
        elif ch == "}":
            if stack:
                kind, start, h = stack.pop()
                if kind == "fn":
                    out.append((line - start + 1, start, h))
            head = ""
        elif ch == ";":
            head = ""
        else:
            head += ch
    return out


def python_functions(text: str):
    return [(n.end_lineno - n.lineno + 1, n.lineno, n.name) for n in ast.walk(ast.parse(text))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _files(top, suffixes):
    for d, dirs, files in os.walk(os.path.join(ROOT, top)):
        dirs[:] = [x for x in dirs if x not in ("__pycache__", "build")]
        for f in sorted(files):
            if f.endswith(suffixes) and "_pb2" not in f:
                yield os.path.join(d, f)


def long_functions():
    found = []
    for top in CPP_DIRS:
        for path in _files(top, CPP_SUFFIXES):
            with open(path, errors="replace") as f:
                found += [(n, path, start, head) for n, start, head in cpp_functions(f.read())]
    for path in _files(os.path.join("python", "kvcal"), (".py",)):
        with open(path) as f:
            found += [(n, path, start, name) for n, start, name in python_functions(f.read())]
    return sorted((r for r in found if r[0] > MAX_LINES), reverse=True)


def test_no_product_function_is_longer_than_80_lines():
    rows = long_functions()
    assert not rows, "functions over %d lines:\n%s" % (MAX_LINES, "\n".join(
        f"  {os.path.relpath(p, ROOT)}:{start} {head[:80]} ({n} lines)" for n, p, start, head in rows))


def test_the_checker_finds_functions_and_only_functions():
    body = "\n".join(f"  x += {i};" for i in range(5))
    text = f"""// a comment {{ with braces }}
#define BRACES {{ \\
  }}
namespace kvcal {{
struct S {{
  int f(int x) const {{
{body}
    if (x) {{ return "}}"[0]; }}
    return x;
  }}
}};
const int kTable[] = {{1, 2, 3}};
absl::Status Long(
    int a,
    int b) {{
{body}
}}
}}  // namespace kvcal
"""
    got = {h.split("(")[0].split()[-1]: n for n, _, h in cpp_functions(text)}
    assert got == {"f": 9, "Long": 7}, got
    assert python_functions("def f():\n    a = 1\n    return a\n") == [(3, 1, "f")]
