import sys

from pdserve.cli.parent import die_with_parent

die_with_parent()  # before the imports below, which take a second or more

try:
    from pdserve.cli.main import main
except KeyboardInterrupt:  # Ctrl-C while the imports ran: nothing started yet, nothing to say
    sys.exit(130)

sys.exit(main())
