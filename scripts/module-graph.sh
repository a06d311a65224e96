#!/usr/bin/env bash
# The library's top-level modules and which use which (any `crate::<module>` path, or `super::`
# from a submodule, outside `#[cfg(test)]` files), then every dependency circle among them
# (strongly connected components), or, with none, the layers. Then the same one level down, for
# the files: within each module, which of its submodules (sibling files, `super::<sibling>` or
# `crate::<module>::<sibling>`) use which, and every circle among them. A module's own file,
# which declares and composes its submodules, and the submodules' uses of it are not counted.
# Exits 1 on any circle. No build needed; reads host/src of the checkout it is in, or of DIR:
# `scripts/module-graph.sh [DIR]`.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 - "${1:-host/src}" <<'PY'
import os, re, sys
src = sys.argv[1]


def files_of(base, m):
    """Module `m`'s files under `base`: `m.rs` and everything in `m/`, unit-test files aside."""
    files = [os.path.join(base, m + '.rs')] if os.path.exists(os.path.join(base, m + '.rs')) else []
    for dirpath, _, names in os.walk(os.path.join(base, m)):
        files += [os.path.join(dirpath, n) for n in names if n.endswith('.rs')]
    return [f for f in files if os.path.basename(f) not in ('tests.rs', 'props.rs')]


def code_of(f):
    """A file's code: without its unit tests (after a `#[cfg(test)] mod tests {`) and its
    comment lines (a doc link is no use)."""
    text = "\n".join(l for l in open(f).read().splitlines() if not l.lstrip().startswith("//"))
    cut = re.search(r'#\[cfg\(test\)\]\s*mod \w+ \{', text)
    return text[:cut.start()] if cut else text


def names_after(prefix, text):
    """The names a path `prefix::name` or `prefix::{a, b}` reaches."""
    used = set(re.findall(prefix + r'(\w+)', text))
    for group in re.findall(prefix + r'\{([^}]*)\}', text):
        used |= set(re.findall(r'(?:^|,)\s*(\w+)', group))
    return used


def circles(nodes, edges):
    """Tarjan's strongly connected components: the circles of a graph."""
    index, low, on, stack, comps, n = {}, {}, set(), [], [], [0]
    def visit(v):
        index[v] = low[v] = n[0]; n[0] += 1; stack.append(v); on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w); low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop(); on.discard(w); comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))
    for v in nodes:
        if v not in index:
            visit(v)
    return comps


sys.setrecursionlimit(10000)

# The top-level modules.
top = sorted({f[:-3] if f.endswith('.rs') else f
             for f in os.listdir(src)
             if (f.endswith('.rs') and f not in ('lib.rs', 'main.rs')) or os.path.isdir(os.path.join(src, f))})
edges = {m: set() for m in top}
for m in top:
    for f in files_of(src, m):
        for used in names_after(r'\bcrate::', code_of(f)):
            if used in edges and used != m:
                edges[m].add(used)
for m in top:
    print(f"{m:10} -> {', '.join(sorted(edges[m])) or '-'}")
comps = circles(top, edges)
print(f"\n{sum(len(e) for e in edges.values())} edges among {len(top)} modules; "
      f"{len(comps)} dependency circle(s)")
for c in comps:
    print("  circle:", ", ".join(c))
if not comps:
    # Layers, bottom first: a module sits one above the highest module it uses, so every
    # arrow points down.
    level = {}
    def depth(v):
        if v not in level:
            level[v] = 1 + max((depth(w) for w in edges[v]), default=-1)
        return level[v]
    for v in top:
        depth(v)
    print("layers (bottom first; each uses only layers below it):")
    for k in range(max(level.values()) + 1):
        print(f"  {k}: {', '.join(sorted(v for v in top if level[v] == k))}")

# The files: the submodules of each module directory, and which of them use which.
file_edges, file_circles, dirs = 0, [], 0
for dirpath, subdirs, names in sorted(os.walk(src)):
    if dirpath == src:
        continue
    rel = os.path.relpath(dirpath, src).replace(os.sep, '::')
    subs = sorted({n[:-3] for n in names if n.endswith('.rs') and n not in ('tests.rs', 'props.rs')}
                  | set(subdirs))
    if len(subs) < 2:
        continue
    dirs += 1
    sub_edges = {m: set() for m in subs}
    for m in subs:
        for f in files_of(dirpath, m):
            text = code_of(f)
            # `super::` from the submodule's own file names a sibling; from deeper, more supers.
            depth = os.path.relpath(f, dirpath).count(os.sep)
            used = names_after(r'\bsuper::' + r'super::' * depth, text)
            used |= names_after(r'\bcrate::' + rel + r'::', text)
            for u in used:
                if u in sub_edges and u != m:
                    sub_edges[m].add(u)
    file_edges += sum(len(e) for e in sub_edges.values())
    for c in circles(subs, sub_edges):
        file_circles.append(f"{rel}: {', '.join(c)}")
print(f"\nfiles: {file_edges} edges among the submodules of {dirs} modules; "
      f"{len(file_circles)} dependency circle(s)")
for c in file_circles:
    print("  circle:", c)
sys.exit(1 if comps or file_circles else 0)
PY
