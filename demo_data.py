"""
The synthetic bilingual demo world: small, seeded, and checkable (prepare_demo.py writes its data set; bench.py
times the stages on its text).

Its world is the capital cities and continents of 103 countries and the sums of two numbers below 20, in
English and Chinese. Pretraining text states every fact (held-out ones included) many times: as sentences in
paragraphs about one country, as runs of sums, and as FAQ-style questions with their answers. SFT conversations
and DPO pairs never mention the held-out countries and sums; eval.jsonl asks about them. So the evaluation
measures whether SFT taught the model to answer in the chat template with what pretraining knew.

It is synthetic: real training uses MiniMind-format files (see README).
"""
import json
import re

# (English name, Chinese name, capital, Chinese capital, continent index into CONTINENTS)
COUNTRIES = [
    # Europe
    ("France", "法国", "Paris", "巴黎", 0), ("Germany", "德国", "Berlin", "柏林", 0),
    ("Italy", "意大利", "Rome", "罗马", 0), ("Spain", "西班牙", "Madrid", "马德里", 0),
    ("Russia", "俄罗斯", "Moscow", "莫斯科", 0), ("Greece", "希腊", "Athens", "雅典", 0),
    ("Portugal", "葡萄牙", "Lisbon", "里斯本", 0), ("Sweden", "瑞典", "Stockholm", "斯德哥尔摩", 0),
    ("Norway", "挪威", "Oslo", "奥斯陆", 0), ("Finland", "芬兰", "Helsinki", "赫尔辛基", 0),
    ("Poland", "波兰", "Warsaw", "华沙", 0), ("Austria", "奥地利", "Vienna", "维也纳", 0),
    ("Ireland", "爱尔兰", "Dublin", "都柏林", 0), ("Belgium", "比利时", "Brussels", "布鲁塞尔", 0),
    ("the Netherlands", "荷兰", "Amsterdam", "阿姆斯特丹", 0), ("Denmark", "丹麦", "Copenhagen", "哥本哈根", 0),
    ("Hungary", "匈牙利", "Budapest", "布达佩斯", 0), ("Switzerland", "瑞士", "Bern", "伯尔尼", 0),
    ("the Czech Republic", "捷克", "Prague", "布拉格", 0), ("Romania", "罗马尼亚", "Bucharest", "布加勒斯特", 0),
    ("Bulgaria", "保加利亚", "Sofia", "索非亚", 0), ("Serbia", "塞尔维亚", "Belgrade", "贝尔格莱德", 0),
    ("Croatia", "克罗地亚", "Zagreb", "萨格勒布", 0), ("Ukraine", "乌克兰", "Kyiv", "基辅", 0),
    ("Iceland", "冰岛", "Reykjavik", "雷克雅未克", 0), ("Slovakia", "斯洛伐克", "Bratislava", "布拉迪斯拉发", 0),
    ("Lithuania", "立陶宛", "Vilnius", "维尔纽斯", 0), ("Latvia", "拉脱维亚", "Riga", "里加", 0),
    ("Estonia", "爱沙尼亚", "Tallinn", "塔林", 0), ("the United Kingdom", "英国", "London", "伦敦", 0),
    ("Albania", "阿尔巴尼亚", "Tirana", "地拉那", 0), ("Belarus", "白俄罗斯", "Minsk", "明斯克", 0),
    # Asia
    ("Japan", "日本", "Tokyo", "东京", 1), ("China", "中国", "Beijing", "北京", 1),
    ("India", "印度", "New Delhi", "新德里", 1), ("Thailand", "泰国", "Bangkok", "曼谷", 1),
    ("Vietnam", "越南", "Hanoi", "河内", 1), ("South Korea", "韩国", "Seoul", "首尔", 1),
    ("Turkey", "土耳其", "Ankara", "安卡拉", 1), ("Iran", "伊朗", "Tehran", "德黑兰", 1),
    ("Indonesia", "印度尼西亚", "Jakarta", "雅加达", 1), ("the Philippines", "菲律宾", "Manila", "马尼拉", 1),
    ("Malaysia", "马来西亚", "Kuala Lumpur", "吉隆坡", 1), ("Pakistan", "巴基斯坦", "Islamabad", "伊斯兰堡", 1),
    ("Bangladesh", "孟加拉国", "Dhaka", "达卡", 1), ("Nepal", "尼泊尔", "Kathmandu", "加德满都", 1),
    ("Mongolia", "蒙古", "Ulaanbaatar", "乌兰巴托", 1), ("Iraq", "伊拉克", "Baghdad", "巴格达", 1),
    ("Saudi Arabia", "沙特阿拉伯", "Riyadh", "利雅得", 1), ("Afghanistan", "阿富汗", "Kabul", "喀布尔", 1),
    ("Laos", "老挝", "Vientiane", "万象", 1), ("Cambodia", "柬埔寨", "Phnom Penh", "金边", 1),
    ("Myanmar", "缅甸", "Naypyidaw", "内比都", 1), ("Syria", "叙利亚", "Damascus", "大马士革", 1),
    ("Jordan", "约旦", "Amman", "安曼", 1), ("Qatar", "卡塔尔", "Doha", "多哈", 1),
    ("Kazakhstan", "哈萨克斯坦", "Astana", "阿斯塔纳", 1), ("Uzbekistan", "乌兹别克斯坦", "Tashkent", "塔什干", 1),
    ("North Korea", "朝鲜", "Pyongyang", "平壤", 1),
    # Africa
    ("Egypt", "埃及", "Cairo", "开罗", 2), ("Kenya", "肯尼亚", "Nairobi", "内罗毕", 2),
    ("Nigeria", "尼日利亚", "Abuja", "阿布贾", 2), ("Morocco", "摩洛哥", "Rabat", "拉巴特", 2),
    ("Ethiopia", "埃塞俄比亚", "Addis Ababa", "亚的斯亚贝巴", 2), ("Ghana", "加纳", "Accra", "阿克拉", 2),
    ("Algeria", "阿尔及利亚", "Algiers", "阿尔及尔", 2), ("Senegal", "塞内加尔", "Dakar", "达喀尔", 2),
    ("Uganda", "乌干达", "Kampala", "坎帕拉", 2), ("Tanzania", "坦桑尼亚", "Dodoma", "多多马", 2),
    ("Zimbabwe", "津巴布韦", "Harare", "哈拉雷", 2), ("Angola", "安哥拉", "Luanda", "罗安达", 2),
    ("Sudan", "苏丹", "Khartoum", "喀土穆", 2), ("Libya", "利比亚", "Tripoli", "的黎波里", 2),
    ("Mali", "马里", "Bamako", "巴马科", 2), ("Zambia", "赞比亚", "Lusaka", "卢萨卡", 2),
    ("Madagascar", "马达加斯加", "Antananarivo", "塔那那利佛", 2), ("Cameroon", "喀麦隆", "Yaounde", "雅温得", 2),
    ("Rwanda", "卢旺达", "Kigali", "基加利", 2),
    # North America
    ("Canada", "加拿大", "Ottawa", "渥太华", 3), ("Mexico", "墨西哥", "Mexico City", "墨西哥城", 3),
    ("Cuba", "古巴", "Havana", "哈瓦那", 3), ("the United States", "美国", "Washington", "华盛顿", 3),
    ("Jamaica", "牙买加", "Kingston", "金斯敦", 3), ("Panama", "巴拿马", "Panama City", "巴拿马城", 3),
    ("Guatemala", "危地马拉", "Guatemala City", "危地马拉城", 3), ("Honduras", "洪都拉斯", "Tegucigalpa", "特古西加尔巴", 3),
    ("Costa Rica", "哥斯达黎加", "San Jose", "圣何塞", 3), ("Nicaragua", "尼加拉瓜", "Managua", "马那瓜", 3),
    ("Haiti", "海地", "Port-au-Prince", "太子港", 3),
    # South America
    ("Brazil", "巴西", "Brasilia", "巴西利亚", 4), ("Argentina", "阿根廷", "Buenos Aires", "布宜诺斯艾利斯", 4),
    ("Peru", "秘鲁", "Lima", "利马", 4), ("Chile", "智利", "Santiago", "圣地亚哥", 4),
    ("Colombia", "哥伦比亚", "Bogota", "波哥大", 4), ("Venezuela", "委内瑞拉", "Caracas", "加拉加斯", 4),
    ("Ecuador", "厄瓜多尔", "Quito", "基多", 4), ("Uruguay", "乌拉圭", "Montevideo", "蒙得维的亚", 4),
    ("Paraguay", "巴拉圭", "Asuncion", "亚松森", 4),
    # Oceania
    ("Australia", "澳大利亚", "Canberra", "堪培拉", 5), ("New Zealand", "新西兰", "Wellington", "惠灵顿", 5),
    ("Fiji", "斐济", "Suva", "苏瓦", 5), ("Papua New Guinea", "巴布亚新几内亚", "Port Moresby", "莫尔兹比港", 5),
    ("Samoa", "萨摩亚", "Apia", "阿皮亚", 5),
]
CONTINENTS = [("Europe", "欧洲"), ("Asia", "亚洲"), ("Africa", "非洲"), ("North America", "北美洲"),
              ("South America", "南美洲"), ("Oceania", "大洋洲")]

# statements for pretraining; the first of each list is also the canonical answer SFT teaches
CAPITAL_EN = ["The capital of {c} is {k}.", "{k} is the capital of {c}.", "{k} is the capital city of {c}."]
CAPITAL_ZH = ["{c}的首都是{k}。", "{k}是{c}的首都。", "{c}的首都是一座名叫{k}的城市。"]
CONTINENT_EN = ["{c} is in {m}.", "{c} is a country in {m}.", "{k}, the capital of {c}, is in {m}."]
CONTINENT_ZH = ["{c}位于{m}。", "{c}是{m}的一个国家。", "{c}的首都{k}位于{m}。"]
SUM_EN = ["{a} + {b} = {s}.", "{a} plus {b} equals {s}.", "The sum of {a} and {b} is {s}."]
SUM_ZH = ["{a}加{b}等于{s}。", "{a} + {b} = {s}。", "{a}与{b}的和是{s}。"]
SUM_DOUBLES = 0.2  # the demo's share of sum paragraphs that add numbers to themselves: its RL task is doubling

CAPITAL_Q_EN = ["What is the capital of {c}?", "Which city is the capital of {c}?", "Tell me the capital of {c}."]
CAPITAL_Q_ZH = ["{c}的首都是哪里？", "{c}的首都是哪座城市？", "请告诉我{c}的首都。"]
CONTINENT_Q_EN = ["Which continent is {c} in?", "Where is {c}?"]
CONTINENT_Q_ZH = ["{c}位于哪个洲？", "{c}在哪里？"]
SUM_Q_EN = ["What is {a} + {b}?", "What is {a} plus {b}?", "Compute {a} + {b}."]
SUM_Q_ZH = ["{a}加{b}等于多少？", "请计算{a}+{b}。", "{a}加{b}是多少？"]
CHAT = [
    ("en", "Hello!", "Hello! How can I help you?"),
    ("en", "Who are you?", "I am nanomind, a small language model."),
    ("en", "Thank you!", "You are welcome."),
    ("zh", "你好！", "你好！有什么可以帮你的吗？"),
    ("zh", "你是谁？", "我是nanomind，一个小型语言模型。"),
    ("zh", "谢谢！", "不客气。"),
]
# made-up words for "repeat after me" turns: answering with a span copied from the question is what a
# question about an unseen country needs, and a few hundred conversations teach it on words that are no facts
SYLLABLES = ["ka", "lo", "mi", "ren", "to", "sa", "vel", "dor", "ni", "qua", "bre", "zu", "pan", "tes", "gor"]
HANZI = "山水风云花石林海天星月光明春秋雨雪金木火土东南西北中和安平宁远长"
ECHO_Q = {"en": ["Repeat after me: {w}", "Say {w}."], "zh": ["请跟我说：{w}", "请重复：{w}"]}


def made_up_words(rng, lang: str) -> str:
    if lang == "en":
        return " ".join("".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3))).capitalize()
                        for _ in range(rng.randint(1, 2)))
    return "".join(rng.choice(HANZI) for _ in range(rng.randint(2, 4)))


SYSTEMS = {"en": ["You are a helpful assistant.", "You are nanomind. Answer briefly."],
           "zh": ["你是一个乐于助人的助手。", "你是nanomind，请简洁地回答。"]}


def sentence(text: str) -> str:
    """English sentences start with a capital letter even when the country does ("the Netherlands")."""
    return text[0].upper() + text[1:]


def capital_qa(country, lang, rng):
    c_en, c_zh, k_en, k_zh, _ = country
    if lang == "en":
        return rng.choice(CAPITAL_Q_EN).format(c=c_en), sentence(CAPITAL_EN[0].format(c=c_en, k=k_en))
    return rng.choice(CAPITAL_Q_ZH).format(c=c_zh), CAPITAL_ZH[0].format(c=c_zh, k=k_zh)


def continent_qa(country, lang, rng):
    c_en, c_zh, k_en, k_zh, m = country
    if lang == "en":
        return rng.choice(CONTINENT_Q_EN).format(c=c_en), sentence(CONTINENT_EN[0].format(c=c_en, m=CONTINENTS[m][0]))
    return rng.choice(CONTINENT_Q_ZH).format(c=c_zh), CONTINENT_ZH[0].format(c=c_zh, m=CONTINENTS[m][1])


def sum_qa(a, b, lang, rng):
    templates, answer = (SUM_Q_EN, SUM_EN[0]) if lang == "en" else (SUM_Q_ZH, SUM_ZH[0])
    return rng.choice(templates).format(a=a, b=b), answer.format(a=a, b=b, s=a + b)


def country_paragraph(rng, lang: str) -> list[str]:
    """2-4 facts about one country, each naming it: repeated names teach a model to copy from its context,
    which is what it later needs to answer a question about a country it never saw a question about."""
    c_en, c_zh, k_en, k_zh, m = rng.choice(COUNTRIES)
    c, k, continent = (c_en, k_en, CONTINENTS[m][0]) if lang == "en" else (c_zh, k_zh, CONTINENTS[m][1])
    templates = (CAPITAL_EN + CONTINENT_EN) if lang == "en" else (CAPITAL_ZH + CONTINENT_ZH)
    return [t.format(c=c, k=k, m=continent) for t in rng.sample(templates, rng.randint(2, 4))]


def sum_paragraph(rng, lang: str, max_number: int, doubles: float) -> list[str]:
    """A few sums: unrelated ones, numbers each added to itself (a + a; a share `doubles` of the paragraphs), or a
    run of the same first number (a + b, a + b+1, ...), which shows how sums grow."""
    templates = SUM_EN if lang == "en" else SUM_ZH
    n = rng.randint(2, 5)
    kind = rng.random()
    if kind < 0.5 - doubles / 2:
        pairs = [(rng.randrange(max_number), rng.randrange(max_number)) for _ in range(n)]
    elif kind < 0.5 + doubles / 2:  # copying an operand is then a pattern pretraining shows: RL's doubling uses it
        pairs = [(a, a) for a in rng.sample(range(max_number), n)]
    else:
        a, b = rng.randrange(max_number), rng.randrange(max_number - n + 1)
        pairs = [(a, b + i) for i in range(n)]
    template = rng.choice(templates)
    return [template.format(a=a, b=b, s=a + b) for a, b in pairs]


def faq_paragraph(rng, lang: str, max_number: int) -> list[str]:
    """1-3 questions with their answers, as a web page's FAQ would have them: about any country or sum, held-out
    ones included. SFT then only has to teach the chat template around what pretraining already knows."""
    items = []
    for _ in range(rng.randint(1, 3)):
        kind = rng.random()
        if kind < 0.35:
            q, a = capital_qa(rng.choice(COUNTRIES), lang, rng)
        elif kind < 0.7:
            q, a = continent_qa(rng.choice(COUNTRIES), lang, rng)
        else:
            q, a = sum_qa(rng.randrange(max_number), rng.randrange(max_number), lang, rng)
        items.append(f"Q: {q} A: {a}" if lang == "en" else f"问：{q}答：{a}")
    return items


def documents(n: int, max_number: int, rng, sum_doubles: float = SUM_DOUBLES) -> list[str]:
    """n short documents in one language each, made of 2-4 paragraphs: facts about a country, a few sums (a share
    sum_doubles of them a + a), or questions and answers. Every fact, held-out ones included, appears many times,
    each time among different neighbours, so a model learns the facts rather than the documents."""
    docs = []
    for _ in range(n):
        lang = rng.choice(["en", "zh"])
        sentences = []
        for _ in range(rng.randint(2, 4)):
            kind = rng.random()
            if kind < 0.3:
                sentences += country_paragraph(rng, lang)
            elif kind < 0.55:
                sentences += faq_paragraph(rng, lang, max_number)
            else:
                sentences += sum_paragraph(rng, lang, max_number, sum_doubles)
        sentences = [sentence(t) for t in sentences] if lang == "en" else sentences
        docs.append((" " if lang == "en" else "").join(sentences))
    return docs


def make_question(rng, countries, pairs) -> tuple[str, str, str]:
    """One random (question, answer, lang) about the allowed countries and number pairs."""
    lang, kind = rng.choice(["en", "zh"]), rng.random()
    if kind < 0.3:
        return (*capital_qa(rng.choice(countries), lang, rng), lang)
    if kind < 0.6:
        return (*continent_qa(rng.choice(countries), lang, rng), lang)
    if kind < 0.7:
        words = made_up_words(rng, lang)
        return rng.choice(ECHO_Q[lang]).format(w=words), words, lang
    return (*sum_qa(*rng.choice(pairs), lang, rng), lang)


def conversation(rng, countries, pairs) -> dict:
    """One SFT record: 1-3 turns, sometimes a greeting first, sometimes a system prompt."""
    messages, langs = [], []
    if rng.random() < 0.15:
        lang, q, a = rng.choice(CHAT)
        messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        langs.append(lang)
    if rng.random() < 0.3:  # both questions about one country: the answer must follow the question, not the name
        country, lang = rng.choice(countries), rng.choice(["en", "zh"])
        turns = [capital_qa(country, lang, rng), continent_qa(country, lang, rng)]
        rng.shuffle(turns)
        for q, a in turns:
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
            langs.append(lang)
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        q, a, lang = make_question(rng, countries, pairs)
        messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        langs.append(lang)
    record = {"conversations": messages}
    if rng.random() < 0.3:
        record["system"] = rng.choice(SYSTEMS[langs[0]])
    return record


def dpo_pair(rng, countries, pairs, as_messages: bool) -> dict:
    """Chosen: the right answer in the asked language. Rejected: the right answer in the other language, or an
    answer to the other question about the same country, or a wrong capital, continent or sum."""
    lang = rng.choice(["en", "zh"])
    other_lang = "zh" if lang == "en" else "en"
    kind = rng.random()
    if rng.random() < 0.6:
        country = rng.choice(countries)
        qa, other_qa = (capital_qa, continent_qa) if rng.random() < 0.5 else (continent_qa, capital_qa)
        question, chosen = qa(country, lang, rng)
        if kind < 0.3:
            rejected = qa(country, other_lang, rng)[1]
        elif kind < 0.65:
            rejected = other_qa(country, lang, rng)[1]
        else:  # the same sentence about a look-alike: another country's capital, another continent
            other = rng.choice([c for c in COUNTRIES if c[4] != country[4]])
            rejected = qa((country[0], country[1], other[2], other[3], other[4]), lang, rng)[1]
    else:
        a, b = rng.choice(pairs)
        question, chosen = sum_qa(a, b, lang, rng)
        if kind < 0.3:
            rejected = (SUM_EN if other_lang == "en" else SUM_ZH)[0].format(a=a, b=b, s=a + b)
        else:
            wrong = rng.choice([s for s in (a + b - 10, a + b - 1, a + b + 1, a + b + 10) if s >= 0])
            rejected = (SUM_EN if lang == "en" else SUM_ZH)[0].format(a=a, b=b, s=wrong)
    if as_messages:
        user = {"role": "user", "content": question}
        return {"chosen": [user, {"role": "assistant", "content": chosen}],
                "rejected": [user, {"role": "assistant", "content": rejected}]}
    return {"prompt": question, "chosen": chosen, "rejected": rejected}


# RL's task (train_grpo.py): doubling, which no SFT conversation asks for. Pretraining's sums include every a + a,
# so the SFT model sometimes answers "What is double 7?" with "7 + 7 = 14." and sometimes with another sum
DOUBLE_Q = ["What is double {a}?", "What is twice {a}?", "Double {a}.", "What is {a} doubled?", "What is {a} times 2?",
            "{a}的两倍是多少？", "{a}乘以2等于多少？", "请把{a}翻倍。"]


def double_prompts(numbers) -> list[dict]:
    """Every doubling question about the numbers, as RL prompts: {"conversations": [user], "answer": 2a}."""
    return [{"conversations": [{"role": "user", "content": q.format(a=a)}], "answer": str(2 * a)}
            for a in numbers for q in DOUBLE_Q]


def doubled_operands(messages, completion: str, record: dict) -> float:
    """The doubling demo's second reward (configs/demo_grpo.py's `reward`): 0.5 when the completion adds the asked
    number to itself ("7 + 7", "7加7"), whatever it says the sum is. The answer reward alone pays only for the
    right double, and a held-out number is never asked in training: adding the number to itself is the step that
    carries over to it, the sum being one pretraining knows."""
    a = int(record["answer"]) // 2
    return 0.5 if re.search(rf"(?<!\d){a}\s*(?:\+|加)\s*{a}(?!\d)", completion) else 0.0


def write_jsonl(path, records):
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def split_world(rng, n_held_countries: int, max_number: int, held_out_sums: float):
    """(held-out countries, training countries, held-out number pairs, training pairs): SFT and DPO data use the
    training ones only; the evaluation asks about the held-out ones."""
    countries = COUNTRIES[:]
    rng.shuffle(countries)
    pairs = [(a, b) for a in range(max_number) for b in range(max_number)]
    rng.shuffle(pairs)
    n_held = int(len(pairs) * held_out_sums)
    return countries[:n_held_countries], countries[n_held_countries:], pairs[:n_held], pairs[n_held:]


def eval_questions(rng, countries, pairs) -> list[dict]:
    """Both capital and continent questions about each country in both languages, and one sum question (in a
    random language) per pair: {kind, lang, question, answer}."""
    evals = []
    for country in countries:
        for lang in ("en", "zh"):
            q, a = capital_qa(country, lang, rng)
            evals.append({"kind": "capital", "lang": lang, "question": q, "answer": a})
        for lang in ("en", "zh"):
            q, a = continent_qa(country, lang, rng)
            evals.append({"kind": "continent", "lang": lang, "question": q, "answer": a})
    for a, b in pairs:
        lang = rng.choice(["en", "zh"])
        q, ans = sum_qa(a, b, lang, rng)
        evals.append({"kind": "sum", "lang": lang, "question": q, "answer": ans})
    return evals


# Tool use (tools.py): products of two numbers, which the model cannot work out itself, answered by calling the
# calculator and stating its result. SFT and RL ask about different numbers; the model learns the call's form and
# to copy numbers from the question into it and from the result into the answer.
# SFT asks the first five; RL and the evaluation all eight. The last three are new to the model, and ones the SFT
# model half-answers: RL learns from the right completions among a group's, and a phrasing it never answers right
# gives RL nothing to learn from (docs/tools.md)
TOOL_Q = ["What is {a} times {b}?", "What is {a} multiplied by {b}?", "Multiply {a} by {b}.", "{a}乘以{b}等于多少？",
          "请计算{a}乘{b}。", "What is the product of {a} and {b}?", "请算出{a}乘以{b}的积。",
          "What do you get when you multiply {a} by {b}?"]
TOOL_A = {"en": "The product is {p}.", "zh": "乘积是{p}。"}  # the result, copied from the tool's answer just above


def tool_record(a: int, b: int, question: str, tools: list[dict], answered: bool = True) -> dict:
    """A tool-calling conversation in MiniMind's layout (tools on the system message): the question, the call,
    the calculator's result, the answer; answered=False: up to the question, with "answer" for RL and eval."""
    lang = "zh" if any("\u4e00" <= ch <= "\u9fff" for ch in question) else "en"
    messages = [{"role": "system", "content": "You are a helpful assistant.", "tools": tools},
                {"role": "user", "content": question}]
    if not answered:
        return {"conversations": messages, "answer": str(a * b)}
    call = {"name": "calculate_math", "arguments": {"expression": f"{a} * {b}"}}
    return {"conversations": messages + [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": json.dumps({"result": a * b})},
        {"role": "assistant", "content": TOOL_A[lang].format(p=a * b)}]}


PRODUCT_EN = ["{a} × {b} = {p}.", "{a} times {b} is {p}.", "The product of {a} and {b} is {p}.",
              "Multiply {a} by {b} and you get {p}.", "What is {a} times {b}? It is {p}.", "calculate_math({a} * {b}) = {p}."]
PRODUCT_ZH = ["{a}乘以{b}等于{p}。", "{a}和{b}的乘积是{p}。", "{a}乘{b}得{p}。", "{a}乘以{b}等于多少？等于{p}。"]


def product_document(rng, tools: list[dict]) -> str:
    """Pretraining text for the tool task: a product stated two to four times, or a question worked through with
    the calculator in plain text; either way the model learns to copy numbers from one place to the next (it cannot
    learn the products: a tool computes them). The questions are SFT's phrasings only (TOOL_Q[:5]), and follow the
    tools' descriptions, as in a chat: the model learns to find the question's numbers past the description's."""
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    if rng.random() < 0.5:
        return " ".join(rng.choice(PRODUCT_EN + PRODUCT_ZH).format(a=a, b=b, p=a * b) for _ in range(rng.randint(2, 4)))
    question = rng.choice(TOOL_Q[:5]).format(a=a, b=b)
    answer = TOOL_A["zh" if "乘" in question else "en"].format(p=a * b)
    described = "\n".join(json.dumps(tool) for tool in tools)
    return f'{described}\n{question}\ncalculate_math {{"expression": "{a} * {b}"}}\n{{"result": {a * b}}}\n{answer}'


def tool_pairs(rng, n: int, low: int = 10, high: int = 99) -> list[tuple[int, int]]:
    """n distinct pairs of numbers in [low, high]."""
    pairs = set()
    while len(pairs) < n:
        pairs.add((rng.randint(low, high), rng.randint(low, high)))
    return sorted(pairs)
