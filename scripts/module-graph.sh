#!/usr/bin/env bash
# The library's top-level modules and which use which (any `crate::<module>` path, or `super::`
# from a submodule, outside `#[cfg(test)]` files), then every dependency circle among them
# (strongly connected components), or, with none, the layers. No build needed; reads host/src of the checkout it is in, or
# of DIR: `scripts/module-graph.sh [DIR]`.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 - "${1:-host/src}" <<'PY'
import os, re, sys
src = sys.argv[1]
top = sorted({f[:-3] if f.endswith('.rs') else f
             for f in os.listdir(src)
             if (f.endswith('.rs') and f not in ('lib.rs', 'main.rs')) or os.path.isdir(os.path.join(src, f))})
edges = {m: set() for m in top}
for m in top:
    files = []
    if os.path.exists(os.path.join(src, m + '.rs')):
        files.append(os.path.join(src, m + '.rs'))
    for dirpath, _, names in os.walk(os.path.join(src, m)):
        files += [os.path.join(dirpath, n) for n in names if n.endswith('.rs')]
    for f in files:
        if os.path.basename(f) == 'tests.rs':
            continue
        text = open(f).read()
        # Code after a `#[cfg(test)] mod tests {` is the module's unit tests.
        cut = re.search(r'#\[cfg\(test\)\]\s*mod \w+ \{', text)
        if cut:
            text = text[:cut.start()]
        for used in re.findall(r'\bcrate::(\w+)', text):
            if used in edges and used != m:
                edges[m].add(used)
        for used in re.findall(r'\buse crate::\{([^}]*)\}', text):
            for name in re.findall(r'(?:^|,)\s*(\w+)', used):
                if name in edges and name != m:
                    edges[m].add(name)
for m in top:
    print(f"{m:10} -> {', '.join(sorted(edges[m])) or '-'}")
# Tarjan's strongly connected components.
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
sys.setrecursionlimit(10000)
for v in top:
    if v not in index:
        visit(v)
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
PY
