from bwstack.cli.main import main

raise SystemExit(main())
