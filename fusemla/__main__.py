"""``python -m fusemla``: the command line (see :mod:`fusemla.cli`)."""

from fusemla.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
