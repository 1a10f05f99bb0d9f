"""Train one attention variant (or sweep many with -m). A thin shim over attnlab.training.cli.main; see the README."""

from attnlab.training.cli import main

if __name__ == "__main__":
    main()
