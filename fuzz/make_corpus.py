"""Write the seed corpora fuzz/corpus/mux/ and fuzz/corpus/legacy/ (``python fuzz/make_corpus.py``).

Each seed is a small, named stream: valid frames of every kind, and the edge and error cases that
tests/test_codec_mux.py and tests/test_codec_legacy.py pin down. The fuzzers read the first bytes
of a seed as a chunking plan as well as stream (fuzz_mux.py), so plain protocol text is a good seed.
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).parent

MUX = {
    # requests
    "submit": b"SUBMIT 1 0 5 128 0.7 0.9\nhello\n",
    "submit_multiline": b"SUBMIT 2 1 17 64 0 1\nline one\nline\x00two\n",
    "submit_utf8": b"SUBMIT 3 0 17 16 1.5 0.95\n" + "café 中文 😀".encode() + b"\n",
    "submit_empty_prompt": b"SUBMIT 4 0 0 16 0.7 0.9\n\n",
    "submit_limits": b"SUBMIT 18446744073709551615 255 1 1048576 1e+300 4.94066e-324\nx\n",
    "submit_seed": b"SUBMIT 5 2 2 64 0.8 0.95 12345\nhi\nSUBMIT 6 0 2 1 1 1 x\nhi\n",
    "cancel": b"CANCEL 7\n",
    "pipeline": (b"SUBMIT 1 0 2 16 0.7 0.9\nhi\nSUBMIT 2 1 3 16 0.7 0.9\na\nb\nCANCEL 1\n"
                 b"CANCEL 2\n"),
    "err_unknown_verb": b"FOO 1\nCANCEL 7\n",
    "err_field_count": b"SUBMIT 1 0 2 16 0.7\nhi\nCANCEL\nCANCEL 1 2\n",
    "err_non_numeric": b"SUBMIT x 0 2 16 0.7 0.9\nhi\nSUBMIT 5 0 two 16 0.7 0.9\nhi\nCANCEL x\n",
    "err_id0": b"SUBMIT 0 0 2 16 0.7 0.9\nhi\nCANCEL 0\n",
    "err_negative": b"SUBMIT -5 0 2 16 0.7 0.9\nhi\nSUBMIT 5 0 -2 16 0.7 0.9\nhi\nCANCEL -7\n",
    "err_temperature": (b"SUBMIT 5 0 2 16 nan 0.9\nhi\nSUBMIT 6 0 2 16 inf 0.9\nhi\n"
                        b"SUBMIT 7 0 2 16 1e999 1\nhi\n"),
    "err_top_p": b"SUBMIT 5 0 2 16 0.7 0\nhi\nSUBMIT 6 0 2 16 0.7 1.5\nhi\n",
    "err_limits": (b"SUBMIT 18446744073709551616 0 2 16 0.7 0.9\nhi\nSUBMIT 5 256 2 16 0.7 0.9\nhi\n"
                   b"SUBMIT 5 0 2 1048577 0.7 0.9\nhi\n"),
    "err_count_short": b"SUBMIT 5 0 1 16 0.7 0.9\nhello\nCANCEL 7\n",
    "err_count_long": b"SUBMIT 5 0 10 16 0.7 0.9\nhi\nCANCEL 7\nCANCEL 8\n",
    "err_no_newline": b"SUBMIT 5 0 2 16 0.7 0.9\nhiX\nCANCEL 7\n",
    "err_crlf": b"SUBMIT 5 0 2 16 0.7 0.9\r\nhi\r\nCANCEL 7\r\n",
    "err_long_line": b"X" * 300 + b"\nCANCEL 7\n",
    "err_oversized_payload": b"SUBMIT 5 0 16777217 16 0.7 0.9\nhello\nCANCEL 7\n",
    "err_utf8": b"SUBMIT 5 0 2 16 0.7 0.9\n\xff\xfe\nCANCEL 7\n",
    "err_eof_payload": b"SUBMIT 5 0 10 16 0.7 0.9\nabc",
    "err_eof_line": b"CANCEL 7\nCANC",
    # responses
    "resp_handshake": (b"\x01\x01READY\x01\x01\nSTAT 0 0.00 0.0 1.25\n"
                       b"HWINFO 16 62.5 40.1 1 80.0 AMD EPYC 7763|NVIDIA H100 80GB\n"
                       b"TIERS 10 20 30 1.50 2.50\nEMAP 2 3 0040809fff01\n"),
    "resp_stream": (b"DATA 1 5\nHello\nTOPK 1 5 -0.1234 48 -1.5000 - -2.0000 0a -3.0000 20 -4.0000 ff\n"
                    b"DATA 1 7\n world\n\nHITS 2 8 0180\nREPIN 3 17 1 0\n"),
    "resp_turn_end": (b"HWINFO 1 0.0 0.0 0 0.0 |\n"
                      b"PERF 1 1.5000 0.1000 0.2000 0.3000 0.4000 0.5000 0.6000 100 23\n"
                      b"ENTROPY 1.500 2.250 0.000\nGPUS 2 10.50 80.00 64 0.00 24.00 0\n"
                      b"TIERS 1 2 3 0.10 0.20\nEMAP 1 1 c0\nHITS 1 1 01\n"
                      b"DONE 1 STAT 10 12.34 56.7 1.23 42 1\n"),
    "resp_errors": (b"ERROR 1 CANCELLED\nERROR 2 CONTEXT_EXCEEDED 5000 4096\nERROR 3 SLOT_BUSY\n"
                    b"ERROR 4 NOT_FOUND\nERROR 5 DUPLICATE_ID\nERROR 6 EMPTY_PROMPT\n"),
    "resp_malformed": (b"PERF 1\nTOPK 1 5 -0.1 61\nERROR 1 NOPE\nEMAP 1 2 abc\nGPUS 2 1.0 2.0 3\n"
                       b"DONE 1\nENTROPY\nWHAT 1 2\nREPIN 1 2 3 4\n"),
    "resp_data_framing": b"DATA 1 2\nhiX\nDATA 2 -1\nhello\nDATA 3 0\n\nDATA 4 1\n\n\nREPIN 1 2 3 4\n",
}

LEGACY = {
    "user_line": b"Tell me what a hummingbird is.\n",
    "user_lines_crlf": b"hello\r\nworld\r\n\r\n",
    "user_line_eof": "unterminated last line, café".encode(),
    "user_empty": b"\n \t \n\r\n",
    "user_bad_utf8": b"\xff\xfe\nok\n",
    "reset_more": b"\x02RESET\n\x02MORE\n\x02RESET\r\n",
    "cancel": b"\x02CANCEL\n",
    "control_unknown": b"\x02FOO\n\x02RESET now\n\x02\n\x02reset\n",
    "prompt": b"\x02PROMPT 5 100 0.7 0.9\nhello\n",
    "prompt_slot": b"\x02PROMPT 10 100 0 1 3\nhello\nyou!\n",
    "prompt_crlf_header": b"\x02PROMPT 5 100 0.7 0.9\r\nhello\n",
    "prompt_utf8": b"\x02PROMPT 12 1048576 1.5 0.95\n" + "café 中文".encode() + b"\n",
    "prompt_bad_fields": (b"\x02PROMPT 5 x 0.7 0.9\nhello\n\x02PROMPT 5 100 nan 0.9\nhello\n"
                          b"\x02PROMPT 5 100 0.7 0\nhello\n\x02PROMPT 5 100 0.7 0.9 x\nhello\n\x02RESET\n"),
    "prompt_bad_count": b"\x02PROMPT x 100 0.7 0.9\nhello\n\x02PROMPT -5 100 0.7 0.9\nhello\n",
    "prompt_field_count": b"\x02PROMPT 5 100 0.7\nhello\n\x02PROMPT 5 100 0.7 0.9 1 2\nhello\n",
    "prompt_empty": b"\x02PROMPT 0 100 0.7 0.9\n\n",
    "prompt_bad_utf8": b"\x02PROMPT 2 100 0.7 0.9\n\xff\xfe\n\x02MORE\n",
    "prompt_no_newline": b"\x02PROMPT 2 100 0.7 0.9\nhiX\n\x02RESET\n",
    "prompt_crlf_payload": b"\x02PROMPT 5 100 0.7 0.9\r\nhello\r\n\x02RESET\n",
    "prompt_count_long": b"\x02PROMPT 4 100 0.7 0.9\nhi\n\x02RESET\n\x02MORE\n",
    "prompt_oversized": b"\x02PROMPT 16777217 100 0.7 0.9\nhello\n\x02RESET\n",
    "prompt_eof_payload": b"\x02PROMPT 5 100 0.7 0.9\nhel",
    "prompt_eof_header": b"\x02PROMPT 5 100 0.7 0.9",
    "user_line_long": b"a" * 300 + b"\n\x02RESET\n",
    # engine output (OutputReader)
    "out_answer": b"Hello, world\n\x01\x01END\x01\x01\nSTAT 12 34.56 78.9 1.23 45 1\n",
    "out_error": b"\x01\x01ERROR EMPTY_PROMPT\x01\x01\n\x01\x01END\x01\x01\nSTAT 0 0.00 0.0 0.00 0 0\n",
    "out_error_unknown": b"\x01\x01ERROR NOPE\x01\x01\n\x01\x01ERROR \x01\x01\n",
    "out_bad_stat": b"text\x01\x01END\x01\x01\nnot a stat line\n\x01\x01END\x01\x01\n\n",
    "out_unknown_sentinel": "\x01\x01WHAT\x01\x01\nafter café\x01\x01END".encode(),
    "out_two_turns": (b"one\x01\x01END\x01\x01\nSTAT 1 1.00 1.0 1.00 1 0\n"
                      b"two\n\x01\x01END\x01\x01\nSTAT 2 2.00 2.0 2.00 2 1\n"),
}


def write(name: str, seeds: dict[str, bytes]) -> None:
    folder = HERE / "corpus" / name
    folder.mkdir(parents=True, exist_ok=True)
    for stem, data in seeds.items():
        (folder / stem).write_bytes(data)


if __name__ == "__main__":
    write("mux", MUX)
    write("legacy", LEGACY)
    print(f"{len(MUX)} mux seeds, {len(LEGACY)} legacy seeds")
