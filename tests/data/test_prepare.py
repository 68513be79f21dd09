"""`or1-trl prepare` (paper §6.1): counts of each step on a fixture built with known duplicates, figures, URLs,
overlaps with an evaluation set and answers that disagree with their solution; nothing from the network."""

import json

import pytest
from datasets import Dataset, load_dataset

from or1_trl.cli import main
from or1_trl.data.prepare import NgramIndex, ngrams, normalize_problem, prepare_dataset
from tests.helpers import released_features, released_row

EVAL = ["Let a b and c be positive integers with a plus b plus c equal to ninety nine find product",
        "A frog jumps along a line of lily pads starting at pad one and moving right each minute and ever"]
assert [len(p.split()) for p in EVAL] == [20, 20]  # 13 word 8-grams each

ROWS = [  # problem, answer, solution; the comment says what prepare must do with the row
    ("What is 2+3?", "5", "2+3 = \\boxed{5}"),                                      # 0 kept
    ("What is 2+3?", "5", "It is \\boxed{5}"),                                      # 1 exact duplicate of 0
    ("what is $2 + 3$ ?", "5", None),                                               # 2 normalised duplicate of 0
    ("What is 2-3?", "-1", "2-3 = \\boxed{-1}"),                                    # 3 kept
    ("In the figure below, find the area of the triangle.", "6", None),             # 4 figure
    ("Download the data from https://example.com and add 1 and 2.", "3", None),     # 5 URL
    ("Solve: " + " ".join(EVAL[0].split()[:15]), "7", None),                        # 6 8 of EVAL[0]'s 13 8-grams
    (" ".join(EVAL[1].split()[:11]) + ". Compute it.", "1", "So \\boxed{1}"),       # 7 4 of 13: below 0.5, kept
    ("What is 6*7?", "42", "6*7 = \\boxed{43}"),                                    # 8 answer disagrees
    ("What is 10/4?", "5/2", "10/4 = \\boxed{2.5}"),                                # 9 kept: 2.5 verifies as 5/2
    ("What is 9-9?", "0", None),                                                    # 10 kept, not verifiable
    ("In the figure below, find the area of the triangle.", "6", None),             # 11 exact duplicate of 4
]


def test_normalised_key():
    assert normalize_problem("What is $1+1$?") == normalize_problem("what is 1 + 1 ?") == "whatis1+1?"
    assert normalize_problem("\\left( x \\right)\\, = 2.") == "(x)=2"
    assert normalize_problem("1+1") != normalize_problem("1-1")


def test_ngram_overlap_is_the_fraction_of_the_evaluation_problems_ngrams():
    index = NgramIndex({"aime": EVAL}, n=8)
    assert index.sizes == [13, 13] and len(ngrams("a b c", 8)) == 1
    assert index.overlaps(ROWS[6][0], threshold=0.5) == [("aime", 0, 8 / 13)]
    assert index.overlaps(ROWS[7][0], threshold=0.5) == []
    assert index.overlaps(ROWS[7][0], threshold=0.3) == [("aime", 1, 4 / 13)]
    assert index.overlaps(EVAL[1].upper(), threshold=1.0) == [("aime", 1, 1.0)]


def test_prepare_counts_each_step_and_writes_kept_and_removed_rows(tmp_path, capsys):
    data = tmp_path / "raw"
    data.mkdir()
    with open(data / "train.jsonl", "w") as f:
        for problem, answer, solution in ROWS:
            f.write(json.dumps({"problem": problem, "answer": answer, "solution": solution}) + "\n")
    with open(tmp_path / "aime.jsonl", "w") as f:
        for problem in EVAL:
            f.write(json.dumps({"problem": problem, "answer": "0"}) + "\n")
    out = tmp_path / "prepared"
    main(["prepare", "--dataset_name", str(data), "--output_dir", str(out), "--problem_column", "problem",
          "--eval_sets", f"aime={tmp_path / 'aime.jsonl'}", "--num_proc", "2"])
    printed = capsys.readouterr().out
    table = printed[: printed.index("Overlapping pairs")].splitlines()
    assert table == [
        "step                                  removed  rows left",
        "rows in                                               12",
        "exact duplicates                            2         10",
        "normalised duplicates                       1          9",
        "figures or URLs                             2          7",
        "overlap with evaluation sets                1          6",
        "answer disagrees with the solution          1          5",
        "rows out                                               5",
        "(1 math row kept without verification: no reference solution, or no answer found in it)",
    ]
    assert "  row 6 ~ aime[0]: 0.62 of its n-grams" in printed
    kept = load_dataset(str(out), split="train")
    assert kept.column_names == ["problem", "answer", "solution"]
    assert kept["problem"] == [ROWS[i][0] for i in (0, 3, 7, 9, 10)]
    removed = [json.loads(line) for line in (out / "removed-train.jsonl").read_text().splitlines()]
    assert [(r["index"], r["reason"]) for r in removed] == [
        (1, "exact_duplicate"), (2, "normalized_duplicate"), (4, "figure_or_url"), (5, "figure_or_url"),
        (6, "contamination"), (8, "answer_mismatch"), (11, "exact_duplicate")]
    by_index = {r["index"]: r for r in removed}
    assert by_index[1]["detail"] == {"duplicate_of": 0} and by_index[11]["detail"] == {"duplicate_of": 4}
    assert by_index[5]["detail"] == {"match": "https://"} and by_index[4]["detail"] == {"match": "In the figure"}
    assert by_index[6]["detail"] == {"overlaps": [{"eval_set": "aime", "eval_row": 0, "overlap": round(8 / 13, 4)}]}
    assert by_index[8]["detail"] == {"golds": ["42"]} and by_index[8]["row"]["solution"] == "6*7 = \\boxed{43}"


def test_prepare_on_the_released_format_and_with_steps_skipped():
    rows = [released_row(q, [a]) for q, a, _ in ROWS]
    dataset = Dataset.from_list(rows, features=released_features())
    result = prepare_dataset(dataset, eval_sets={"aime": EVAL})
    assert result.counts() == {"exact_duplicate": 2, "normalized_duplicate": 1, "figure_or_url": 2,
                               "contamination": 1, "answer_mismatch": 0}
    assert result.skipped == {"answer_mismatch": "no column 'solution'"}
    skipped = prepare_dataset(dataset, eval_sets={"aime": EVAL}, skip=("dedup", "decontaminate"))
    assert skipped.counts() == {"exact_duplicate": 0, "normalized_duplicate": 0, "figure_or_url": 3,
                                "contamination": 0, "answer_mismatch": 0}
    assert "(skipped: --skip)" in skipped.table().splitlines()[2]


def test_prepare_usage_errors(capsys, tmp_path):
    for argv, message in (
        (["--skip", "dedupe"], "--skip dedupe: unknown step; the steps are dedup, figures, decontaminate, verify"),
        (["--overlap_threshold", "0"], "--ngram must be >= 1 and --overlap_threshold in (0, 1]"),
    ):
        with pytest.raises(SystemExit) as exc:
            main(["prepare", "--dataset_name", "x", "--output_dir", str(tmp_path), *argv])
        assert exc.value.code == 2 and message in capsys.readouterr().err
