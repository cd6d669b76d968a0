from rayhf.cli.main import main

main()
