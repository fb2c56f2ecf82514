"""`python -m service [options]` is `pagedserve serve [options]`."""

import sys

from service.cli import main

if __name__ == "__main__":
    args = sys.argv[1:]
    if not args or args[0] not in ("serve", "generate"):
        args = ["serve", *args]
    sys.exit(main(args))
