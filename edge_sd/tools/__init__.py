"""The tools around the runtime: the command line, calibration, prompt sets and the files they fetch."""
