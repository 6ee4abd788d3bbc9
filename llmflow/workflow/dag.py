"""Dependency order of stages, and the cycle that prevents one."""

from __future__ import annotations

from collections.abc import Iterable


def find_cycle(needs: dict[str, list[str]]) -> list[str] | None:
    """A dependency cycle as ``[a, b, a]`` (a needs b needs a), or None. Deterministic: the first
    cycle reached walking stages in definition order."""
    state: dict[str, int] = {}  # 1 visiting, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in needs.get(node, []):
            if dep not in needs:
                continue
            if state.get(dep) == 1:
                return stack[stack.index(dep) :] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in needs:
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def topological_order(needs: dict[str, list[str]]) -> list[str]:
    """Stages so that each comes after everything it needs; ties keep definition order.
    Assumes no cycle (``find_cycle`` first)."""
    done: list[str] = []
    placed: set[str] = set()
    remaining = list(needs)
    while remaining:
        for node in remaining:
            if all(d in placed or d not in needs for d in needs[node]):
                done.append(node)
                placed.add(node)
                remaining.remove(node)
                break
        else:
            raise ValueError(f"dependency cycle among {remaining}")
    return done


def downstream(needs: dict[str, list[str]], roots: Iterable[str]) -> set[str]:
    """``roots`` and every stage that (transitively) needs one of them."""
    out = set(roots)
    changed = True
    while changed:
        changed = False
        for node, deps in needs.items():
            if node not in out and any(d in out for d in deps):
                out.add(node)
                changed = True
    return out


def upstream(needs: dict[str, list[str]], roots: Iterable[str]) -> set[str]:
    """Every stage that ``roots`` (transitively) need, without the roots themselves."""
    out: set[str] = set()
    todo = [d for r in roots for d in needs.get(r, [])]
    while todo:
        node = todo.pop()
        if node not in out:
            out.add(node)
            todo.extend(needs.get(node, []))
    return out
