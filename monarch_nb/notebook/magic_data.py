"""The ``%monarch`` commands that move values between the notebook and the ranks: push, pull,
scatter and gather. push and scatter take Python expressions, which they read from the raw text
(argparse would split them on their spaces); pull and gather take ``args`` as the others do."""

from __future__ import annotations

import ast

from IPython.core.error import UsageError

from monarch_nb.notebook.magic_args import pop_targets, split_items
from monarch_nb.notebook.magic_cluster import controller, guard


def evaluate(magics, expr: str):
    """``expr`` in the notebook's namespace; what goes wrong is the user's, in one line."""
    try:
        return eval(expr, magics.shell.user_ns)
    except Exception as e:
        raise UsageError(
            f"cannot evaluate {expr.strip()!r} in the notebook: {type(e).__name__}: {e}"
        ) from None


def push(magics, text: str) -> None:
    """``a b=f(x, y) [--targets SPEC]``: the notebook's ``a``, and ``f(x, y)`` evaluated here,
    as ``a`` and ``b`` on the ranks."""
    targets, text = pop_targets(text)
    ctl = controller()
    if not text.strip():
        raise UsageError("usage: %monarch push NAME [NAME=EXPR ...] [--targets SPEC]")
    try:
        call = ast.parse(f"_({split_items(text)})", mode="eval").body
    except SyntaxError:
        raise UsageError(
            f"push: cannot read {text.strip()!r}; write names and NAME=EXPR "
            "items, with spaces inside an expression in parentheses"
        ) from None
    values = {}
    user_ns = magics.shell.user_ns
    for node in call.args:
        if not isinstance(node, ast.Name):
            raise UsageError(f"push: {ast.unparse(node)!r} is not a name; use NAME=EXPR")
        if node.id not in user_ns:
            raise UsageError(f"push: {node.id!r} is not defined in the notebook")
        values[node.id] = user_ns[node.id]
    for kw in call.keywords:
        if kw.arg is None:
            raise UsageError("push: **mapping is not supported; use NAME=EXPR")
        values[kw.arg] = evaluate(magics, ast.unparse(kw.value))
    guard(lambda: ctl.push(values, targets))


def scatter(magics, text: str):
    """``NAME SEQUENCE [--targets SPEC]``: the sequence, evaluated here, split across the ranks."""
    targets, text = pop_targets(text)
    name, _, expr = text.strip().partition(" ")
    if not name or not expr.strip():
        raise UsageError("usage: %monarch scatter NAME SEQUENCE [--targets SPEC]")
    return guard(lambda: controller().scatter(name, evaluate(magics, expr), targets))


def pull(magics, args):
    names = args.names
    return guard(lambda: controller().pull(names if len(names) > 1 else names[0], args.targets))


def gather(magics, args):
    return guard(lambda: controller().gather(args.name, args.targets))
