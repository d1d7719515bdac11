"""``python -m k3compile``: the same command line as the ``k3compile`` script."""

from k3compile.cli import main

if __name__ == "__main__":
    main()
