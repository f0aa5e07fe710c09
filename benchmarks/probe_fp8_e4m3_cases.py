CHECK = (64, 1024, 4096)
CASES = {64: [None], 1024: [None], 4096: [None], 8192: [None]}
