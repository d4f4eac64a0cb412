from adapterpack.cli.app import main

main()
