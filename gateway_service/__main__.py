"""`python -m gateway_service` = `tandem gateway`."""

import sys

from shared.cli import main

if __name__ == "__main__":
    sys.exit(main(["gateway", *sys.argv[1:]]))
