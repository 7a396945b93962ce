"""`sm70ctl warmup`: fill the compile caches under a fingerprinted folder, and check them."""
