from fd.cli.main import main

raise SystemExit(main())
