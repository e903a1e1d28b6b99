import sys

try:
    from pdserve.cli.main import main
except KeyboardInterrupt:  # Ctrl-C while the imports ran: nothing started yet, nothing to say
    sys.exit(130)

sys.exit(main())
