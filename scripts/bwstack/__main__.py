from bwstack.cli import main

raise SystemExit(main())
