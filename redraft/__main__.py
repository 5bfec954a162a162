from redraft.cli import main

raise SystemExit(main())
