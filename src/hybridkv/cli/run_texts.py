"""Built-in text prompts of ``hybridkv run`` for models with real weights and a tokenizer.

Every prompt is one shared passage (about 560 Gemma tokens: longer than Gemma 3 270M's
512-token sliding window, so a cached prefix must bring the window's blocks back too) followed
by its own question.  The passage describes an invented town; it was written for hybridkv.
No torch.
"""

from __future__ import annotations

__all__ = ["SAMPLE_PASSAGE", "SAMPLE_QUESTIONS", "sample_prompts"]

_PARAGRAPHS = (
    (
        "The harbour town of Keldmouth sits where the river Ousel meets a cold grey sea. For "
        "three centuries its people lived from herring, salt and rope. The herring came in "
        "spring, when the shoals followed warm water along the coast, and every household that "
        "owned a boat sent it out before dawn. Women and children gutted the catch on long "
        "tables by the quay, packed it in barrels between layers of coarse salt, and rolled the "
        "barrels into warehouses that still line the waterfront today. Rope was made in a walk "
        "four hundred metres long, the longest building in the county, where spinners walked "
        "backwards twisting hemp into yarn, and the yarn into strands, and the strands into "
        "cables thick enough to hold a ship at anchor in a gale. Salt came from pans on the "
        "marshes south of the town, where seawater was let in at high tide and boiled over peat "
        "fires until only white crystals were left."
    ),
    (
        "In the eighteen hundreds the railway arrived. A line was built along the river valley, "
        "and for the first time fish could reach the inland cities while it was still fresh. "
        "The salting trade declined within a generation, and the pans on the marsh were "
        "abandoned to the birds. The ropewalk kept working longer, supplying the navy until "
        "steel cable replaced hemp, and it finally closed in the year the old lighthouse was "
        "rebuilt in stone. The town changed its face as well: the railway company built a hotel "
        "on the cliff, a promenade was laid along the beach, and visitors began to come for the "
        "sea air rather than for trade."
    ),
    (
        "Today Keldmouth has about nine thousand inhabitants. The harbour holds a small fishing "
        "fleet of eleven boats, a lifeboat station and a marina for yachts. The ropewalk is a "
        "museum where visitors can try the spinning wheel and see how a cable is laid. The salt "
        "marsh is a nature reserve known for its wading birds, especially the redshank and the "
        "avocet, which nest on the islands left between the old pans. A ferry crosses the "
        "estuary every half hour in summer and every hour in winter; it is the last chain ferry "
        "in the region still pulled across the water on cables laid on the river bed. The town "
        "council meets in the former customs house, and the weekly market is held on Thursdays "
        "in the square behind it, where farmers from the valley sell cheese, apples, honey and "
        "smoked fish."
    ),
    (
        "The town's calendar is built around the sea. In May the blessing of the boats opens "
        "the season, and every boat in the harbour is decorated with flags. In August the "
        "regatta brings rowing crews from all along the coast, and the final race is rowed from "
        "the lighthouse to the quay. In November a lantern procession remembers the fishermen "
        "who did not come home, and the names of the lost are read aloud on the harbour wall."
    ),
)

#: The shared passage (paragraphs separated by blank lines).
SAMPLE_PASSAGE = "\n\n".join(_PARAGRAPHS)

#: One question per request, cycled when more requests are asked for.
SAMPLE_QUESTIONS = (
    "How long is the ropewalk in Keldmouth?",
    "Which birds nest on the salt marsh?",
    "On which day is the weekly market held?",
    "What replaced hemp rope in the navy?",
    "How often does the ferry cross the estuary in winter?",
    "Where does the town council meet?",
    "What brought fresh fish to the inland cities?",
    "Which race ends the August regatta?",
)


def sample_prompts(n: int) -> list[str]:
    """``n`` prompts: the passage, then a question and ``Answer:`` (questions cycled)."""
    return [
        f"{SAMPLE_PASSAGE}\n\nQuestion: {SAMPLE_QUESTIONS[i % len(SAMPLE_QUESTIONS)]}\nAnswer:"
        for i in range(n)
    ]
