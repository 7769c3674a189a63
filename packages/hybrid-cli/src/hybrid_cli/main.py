def main(argv=None):
    raise SystemExit("hybrid: not yet")
