"""Records and vocabulary every other layer speaks: errors, options, ops, sites, selectors,
recordings. Imports nothing of fxprobe above it."""
