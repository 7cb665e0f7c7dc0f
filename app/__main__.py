from app.tools.cli import main

main()
