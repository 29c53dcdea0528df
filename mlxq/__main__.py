from .cli import main

# Guarded: the media decoders' child processes import the main module again (multiprocessing).
if __name__ == "__main__":
    main()
