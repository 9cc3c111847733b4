import sys, json
for line in open(sys.argv[1]):
    parts = line.split(' ', 3)
    if len(parts) < 4: print(line.strip()); continue
    a, f, n, js = parts
    try: r = json.loads(js)
    except Exception: print(line.strip()[:300]); continue
    if 'error' in r: print(f"{a:18s} {n:5s} ERROR {r['error'][:200]}"); continue
    print(f"{a:18s} {n:5s} cos={r['cos']:.4f} nq={r['nq']:3d} keptlin={r['nkept_linear']:2d} kept={r['worst_kept'][0]:>7s} {r['worst_kept'][1][-45:]:45s} q={r['worst_q'][0]:>7s} {r['worst_q'][1][-50:]:50s} miss={r['n_missing']} unexp={r['n_unexpected']} {r['missing'][:1]} {r['unexpected'][:1]}")
