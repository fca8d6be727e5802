"""Movie titles: every release's movies file, and files that are not one."""

from __future__ import annotations

import pytest
from conftest import write_movies

from recommendation.data import movie_titles
from recommendation.data.movielens import DataError

TITLES = {1: "Toy Story (1995)", 29: "City of Lost Children, The (Cité des enfants, La) (1995)"}


@pytest.mark.parametrize("kind", ["movies.dat", "movies.csv", "u.item"])
def test_reads_movie_titles_of_every_release(tmp_path, kind):
    path = write_movies(str(tmp_path / kind), TITLES, kind)
    assert movie_titles.read_movie_titles(path) == TITLES


@pytest.mark.parametrize(
    "name,contents,message",
    [
        ("movies.dat", b"1::Toy Story (1995)::Animation\n2::Jumanji\n", "movies.dat:2: expected"),
        ("movies.dat", b"1::1193::5::978300760\n", "is it a movies file"),  # ratings.dat
        ("movies.csv", b"userId,movieId,rating\n1,2,3\n", "movies.csv:1: expected the header"),
        ("movies.csv", b"movieId,title,genres\n1,\xe9,Drama\n", "is not utf-8"),
        ("u.data", b"1\t2\t3\t4\n", "is not a MovieLens movies file"),
        ("movies.dat", b"", "is empty"),
    ],
)
def test_bad_movies_files_are_named_with_the_fix(tmp_path, name, contents, message):
    path = tmp_path / name
    path.write_bytes(contents)
    with pytest.raises(DataError, match=message):
        movie_titles.read_movie_titles(str(path))
