"""Print the columns of bench/serve.py's table that the GPU session scripts read, then its phase table.

    python3 bench/serve_summary.py "$OUT/serve.md"
"""
import sys

COLUMNS = (0, 7, 8, 9, 11, 12, 13, 16, 17, 19, 20, 24, 25)


def main(path):
    try:
        lines = open(path).read().splitlines()
    except OSError:
        sys.exit(f"no {path}")
    start = next((k for k, line in enumerate(lines) if line.startswith("Where a call's time goes")), None)
    print("model (sync) | c | infer/s | p50 ms | p99 ms | server us/req | queue us/req | requests/call | call ms"
          " | loop %core | engine %core | errors | wrong")
    for line in lines[:start]:
        cells = [x.strip() for x in line.split("|")[1:-1]]
        if line.startswith("| bert") and len(cells) > 25:
            print(" | ".join(cells[i] for i in COLUMNS))
    if start is None:
        sys.exit("no phase table (the server kept no call_phases?)")
    print()
    print("\n".join(line for line in lines[start:] if line.strip()))


if __name__ == "__main__":
    main(sys.argv[1])
