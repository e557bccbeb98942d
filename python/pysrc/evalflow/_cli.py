"""The `evalflow` command installed by the Python package: the same CLI, in process."""

import sys

from . import _native


def main() -> None:
    """Runs `evalflow ARGS...` as the binary does: the error on stderr, its exit code."""
    try:
        code, message, _ = _native.invoke(sys.argv[1:])
    except KeyboardInterrupt:
        # As the binary killed by SIGINT: committed parts stay, the next command resumes.
        sys.exit(130)
    if code != 0:
        print(f"error: {message}", file=sys.stderr)
    sys.exit(code)


if __name__ == "__main__":
    main()
