from fedmvp_apps.cli import main

main()
