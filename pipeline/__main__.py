from tbpipe.pipeline.cli import main

main()
