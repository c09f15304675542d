#!/usr/bin/env python3
"""Module dependency cycles in each crate's src (supervisor, worker and shared by
default, or the src folders given): one node per module file; an edge for every
`crate::a::b` or `super::a` path (in `use` or inline, tests excluded) resolved to the
longest module that exists. Prints each strongly connected component of more than one
node; exits 1 when there is one. supervisor/tests/module_cycles.rs is the same check
in CI."""
import os, re, sys
def check(root):
    mods = {}
    for dp, _, fs in os.walk(root):
        for f in fs:
            if not f.endswith('.rs') or f == 'main.rs': continue
            rel = os.path.relpath(os.path.join(dp, f), root)[:-3].split(os.sep)
            if rel[-1] in ('mod', 'lib'): rel = rel[:-1]
            mods['::'.join(rel)] = os.path.join(dp, f)
    COLLAPSE = []
    def node(m):
        for c in COLLAPSE:
            if m == c or m.startswith(c + '::'): return c
        return m
    def resolve(path):
        parts = path.split('::')
        for n in range(len(parts), 0, -1):
            if '::'.join(parts[:n]) in mods: return '::'.join(parts[:n])
        return ''
    edges = {}
    for m, f in mods.items():
        src = open(f).read()
        src = re.split(r'#\[cfg\(test\)\]', src)[0]
        src = re.sub(r'//[^\n]*', '', src)
        # expand `use crate::{a, b::c}` one level
        paths = []
        for g in re.finditer(r'crate::\{([^}]*)\}', src):
            paths += [p.strip().split(' ')[0] for p in g.group(1).split(',') if p.strip()]
        for g in re.finditer(r'crate((?:::[a-z_][a-z0-9_]*)+)', src):
            paths.append(g.group(1)[2:])
        # super:: inside a module file
        for g in re.finditer(r'\bsuper((?:::[a-z_][a-z0-9_]*)+)', src):
            base = m.split('::')[:-1] if not f.endswith('mod.rs') else m.split('::')[:-1]
            paths.append('::'.join(base + g.group(1)[2:].split('::')))
        for p in paths:
            t = resolve(p)
            a, b = node(m), node(t)
            if t and a != b:
                edges.setdefault(a, set()).add(b)
    # Tarjan
    idx, low, st, on, out, c = {}, {}, [], set(), [], [0]
    def sc(v):
        idx[v] = low[v] = c[0]; c[0] += 1; st.append(v); on.add(v)
        for w in edges.get(v, ()):
            if w not in idx: sc(w); low[v] = min(low[v], low[w])
            elif w in on: low[v] = min(low[v], idx[w])
        if low[v] == idx[v]:
            comp = []
            while True:
                w = st.pop(); on.discard(w); comp.append(w)
                if w == v: break
            if len(comp) > 1: out.append(comp)
    sys.setrecursionlimit(10000)
    for v in set(map(node, mods)):
        if v not in idx: sc(v)
    for comp in out:
        print('cycle:', ', '.join(sorted(comp)))
        for a in sorted(comp):
            print('   ', a, '->', ', '.join(sorted(b for b in edges.get(a, ()) if b in comp)))
    print(f'{len(mods)} modules, {sum(len(v) for v in edges.values())} edges, {len(out)} cycle(s)')
    return len(out)

roots = sys.argv[1:] or ['supervisor/src', 'worker/src', 'shared/src']
found = 0
for r in roots:
    print('==', r)
    found += check(r)
sys.exit(1 if found else 0)
