"""`python -m drafter_service` = `tandem drafter`."""

import sys

from shared.cli import main

if __name__ == "__main__":
    sys.exit(main(["drafter", *sys.argv[1:]]))
