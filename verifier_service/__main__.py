"""`python -m verifier_service` = `tandem verifier`."""

import sys

from shared.cli import main

if __name__ == "__main__":
    sys.exit(main(["verifier", *sys.argv[1:]]))
