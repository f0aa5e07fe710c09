CHECK = (64, 1024, 4096)
CASES = {
    1024: [None, F(128, 64, 4, 6, pdl=True, narrow_t=32)],
    4096: [None, F(128, 64, 4, 6, pdl=True, narrow_t=32, half_pair_rows=True), F(128, 64, 4, 4, pdl=True, narrow_t=16, half_pair_rows=True)],
    8192: [None, F(128, 64, 4, 6, pdl=True, narrow_t=32, half_pair_rows=True), F(128, 64, 4, 4, pdl=True, narrow_t=16, half_pair_rows=True)],
}
